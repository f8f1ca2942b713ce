// NCCL-backed Communicator: tally's collectives over NVIDIA GPUs, for builds
// with the CUDA toolkit (TALLY_CUDA_ENABLED).
//
// tally drives NCCL itself rather than through c10d's ProcessGroupNCCL (which
// Debian's CPU LibTorch lacks). The ranks of a group find each other through
// the same c10d::Store the Gloo groups use: rank 0 creates the ncclUniqueId and
// publishes it under `<prefix>/nccl_id`; the other ranks wait for that key,
// every rank marks `<prefix>/joined/<rank>` and waits for the others' marks
// (both within the store's timeout), then every rank joins with
// ncclCommInitRank on its own device.
//
// CUDA tensors (a LibTorch with CUDA, TALLY_TORCH_CUDA) go to NCCL as they
// are, on the communicator's stream, after the work LibTorch queued on the
// calling thread's current stream. CPU tensors are copied into a reusable
// device buffer and back (two PCIe copies per call). Either way a call
// returns once the op is complete. Dtypes: float32, float64, bfloat16, int64,
// uint8; bfloat16 all-reduces and reduce-scatters are summed in float32 and
// rounded once, as the Gloo communicator does. Reduce-scatter is NCCL's
// native op. A call not complete within `timeout` aborts the communicator.
//
// InstallNcclCommunicators() makes this the communicator of CUDA meshes
// (ProcessGroups::Create and MakeSingleRankCommunicator with a CUDA device):
// tally_runtime cannot depend on this library, so a binary that links it
// installs it once at start-up.
//
//   tally::InstallNcclCommunicators();  // in main()
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
#include "absl/time/time.h"
#include "runtime/parallel/communicator.h"

namespace tally {

// Joins the NCCL communicator of `size` ranks named by `prefix` as `rank`,
// using CUDA device `device`; blocks until every rank has joined. `prefix`
// must name one group only once in `store` (a reused key hands out a stale
// id). INVALID_ARGUMENT, starting with the field's name, for a null store, a
// rank, size or device out of range or a timeout that is not positive;
// FAILED_PRECONDITION when no CUDA device is usable; INTERNAL naming the key
// when a rank other than 0 finds no id within the store's timeout;
// DEADLINE_EXCEEDED naming the missing ranks when a peer does not join within
// it; INTERNAL naming the call for any CUDA or NCCL failure. After an
// asynchronous NCCL error (a peer died mid-collective) or a call still
// running after `timeout`, the communicator aborts: that call and every later
// one return the error (Communicator::failure()).
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
    int size, int device, absl::Duration timeout = kDefaultCollectiveTimeout);

// Makes MakeNcclCommunicator the communicator of CUDA meshes
// (SetCudaCommunicatorFactory). Idempotent.
void InstallNcclCommunicators();

}  // namespace tally

#endif  // TALLY_RUNTIME_CUDA_NCCL_COMMUNICATOR_H_
