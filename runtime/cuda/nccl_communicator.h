// NCCL-backed Communicator: tally's collectives over NVIDIA GPUs, for builds
// with the CUDA toolkit (TALLY_CUDA_ENABLED).
//
// Debian's LibTorch is CPU-only (no ProcessGroupNCCL), so tally drives NCCL
// itself. The ranks of a group find each other through the same c10d::Store
// the Gloo groups use: rank 0 creates the ncclUniqueId and publishes it under
// `<prefix>/nccl_id`; the other ranks wait for that key with the store's
// timeout, then every rank joins with ncclCommInitRank on its own device.
//
// Tensors are LibTorch CPU tensors (this LibTorch has no CUDA tensors): each
// call copies them into a reusable device buffer, runs the NCCL op on a
// dedicated stream and copies the result back before returning. A CUDA
// LibTorch build would hand NCCL the tensors' device pointers instead; the
// staging exists so that this NCCL code compiles and runs on a GPU machine
// with the CPU LibTorch, and it costs two PCIe copies per call. Supported
// dtypes: float32, float64, int64, uint8. Reduce-scatter is NCCL's native op.
//
//   // `store` is the rendezvous store the Gloo groups use (a TCPStore).
//   TALLY_ASSIGN_OR_RETURN(
//       std::unique_ptr<tally::Communicator> tp,
//       tally::MakeNcclCommunicator(store, "nccl/tp/0,1", rank, /*size=*/2,
//                                   /*device=*/local_rank));
//   torch::Tensor max_logit = logits.amax(-1);
//   TALLY_RETURN_IF_ERROR(tp->AllReduce(max_logit, tally::ReduceOp::kMax));
#ifndef TALLY_RUNTIME_CUDA_NCCL_COMMUNICATOR_H_
#define TALLY_RUNTIME_CUDA_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"
#include "runtime/communicator.h"

namespace tally {

// Joins the NCCL communicator of `size` ranks named by `prefix` as `rank`,
// using CUDA device `device`; blocks until every rank has joined. `prefix`
// must name one group only once in `store` (a reused key hands out a stale
// id). INVALID_ARGUMENT, starting with the field's name, for a null store or
// a rank, size or device out of range; FAILED_PRECONDITION when no CUDA
// device is usable; INTERNAL naming the key when a rank other than 0 finds no
// id within the store's timeout, and naming the call for any CUDA or NCCL
// failure. After an asynchronous NCCL error (a peer died mid-collective) the
// communicator aborts: that call and every later one return the error.
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
    int size, int device);

}  // namespace tally

#endif  // TALLY_RUNTIME_CUDA_NCCL_COMMUNICATOR_H_
