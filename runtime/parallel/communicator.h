// Communicator: the collectives tally's runtime needs, over one group of
// ranks, with call and byte counters per operation.
//
// A small interface in the spirit of c10d's ProcessGroup: the runtime talks to
// this, never to a backend, so tests can count collectives and a backend
// without a native op (Gloo has no reduce-scatter) gets a documented fallback.
// Every call is synchronous and applies in place where the op allows, except
// AllReduceAsync, which returns at once (c10d's Work) so that a caller can
// overlap the collective with computation.
//
//   std::unique_ptr<tally::Communicator> world = ...;
//   torch::Tensor sq = torch::zeros({2}, torch::kFloat64);
//   TALLY_RETURN_IF_ERROR(world->AllReduce(sq, tally::ReduceOp::kSum));
//   int64_t n = world->stats().Get(tally::CommOp::kAllReduce).calls;
//
//   tally::PendingCollective sum = world->AllReduceAsync(buf, kSum);
//   ...  // compute; `buf` stays untouched
//   TALLY_RETURN_IF_ERROR(sum.Wait());
//
// A rank that fails between two collectives while its peers wait in the
// next one calls CloseConnections(): its peers' collectives then fail at once
// instead of waiting out the timeout, and Rejoin() later puts a freshly formed
// group of the same ranks under the same Communicator
// (runtime/parallel/distributed.h). Once a group failed, a wait for one of its
// all-reduces in flight returns the failure at once (the backend may otherwise
// hold an operation posted on a connection that already failed until its
// timeout).
#ifndef TALLY_RUNTIME_PARALLEL_COMMUNICATOR_H_
#define TALLY_RUNTIME_PARALLEL_COMMUNICATOR_H_

#include <torch/torch.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "runtime/parallel/torch_compat.h"

namespace gloo::transport {
class Device;
}  // namespace gloo::transport

namespace tally {

// How long a collective waits for its peers before failing (a dead or hung
// rank): long enough for a slow checkpoint write on rank 0.
inline constexpr absl::Duration kDefaultCollectiveTimeout = absl::Minutes(10);

enum class ReduceOp { kSum, kMax };

enum class CommOp {
  kAllReduce = 0,
  kAllGather,
  kReduceScatter,
  kBroadcast,
  kSend,
  kRecv,
};
inline constexpr int kNumCommOps = 6;
const char* CommOpName(CommOp op);  // "all_reduce"

struct CommCounter {
  int64_t calls = 0;
  int64_t bytes = 0;  // payload bytes this rank contributed
};

class CommStats {
 public:
  void Record(CommOp op, int64_t bytes);
  const CommCounter& Get(CommOp op) const {
    return counters_[static_cast<int>(op)];
  }
  int64_t TotalCalls() const;
  void Reset() { counters_ = {}; }

 private:
  std::array<CommCounter, kNumCommOps> counters_{};
};

// A collective in flight: Wait() blocks until it completes and returns its
// status; later calls return the same status without waiting.
class PendingCollective {
 public:
  explicit PendingCollective(std::function<absl::Status()> wait)
      : wait_(std::move(wait)) {}
  // One that already finished (or never started) with `status`.
  static PendingCollective Done(absl::Status status);

  absl::Status Wait();

 private:
  std::function<absl::Status()> wait_;
  std::optional<absl::Status> status_;
};

class Communicator {
 public:
  Communicator();
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual absl::Status AllReduce(torch::Tensor& tensor, ReduceOp op) = 0;
  // Starts the all-reduce of `tensor` (contiguous) in place and returns
  // without waiting for it; `tensor` must stay alive and untouched until
  // Wait(). Collectives of one group still pair up across ranks in the order
  // they were started. Once the group failed (failure()), Wait() returns
  // that failure without waiting longer: the backend keeps its own reference
  // to `tensor` and may still write it until it ends the operation. This
  // default runs AllReduce before returning, for backends that cannot start
  // one and continue.
  virtual PendingCollective AllReduceAsync(torch::Tensor tensor, ReduceOp op);
  // Concatenates every rank's `input` (same shape everywhere) along dim 0.
  virtual absl::StatusOr<torch::Tensor> AllGather(
      const torch::Tensor& input) = 0;
  // Sums `input` (dim 0 divisible by size()) across ranks and returns this
  // rank's dim-0 slice.
  virtual absl::StatusOr<torch::Tensor> ReduceScatter(
      const torch::Tensor& input) = 0;
  virtual absl::Status Broadcast(torch::Tensor& tensor, int root) = 0;
  virtual absl::Status Send(const torch::Tensor& tensor, int dst) = 0;
  virtual absl::Status Recv(torch::Tensor& tensor, int src) = 0;
  // Sends `send` to `dst` while receiving `recv` from `src`, both posted
  // before either is waited on: two ranks exchanging (a pipeline's
  // activations one way, their gradients the other) cannot deadlock on
  // a rendezvous send, as two blocking Sends would.
  virtual absl::Status SendRecv(const torch::Tensor& send, int dst,
                                torch::Tensor& recv, int src);

  CommStats& stats() { return stats_; }
  const CommStats& stats() const { return stats_; }

  // The first error a collective of this group returned, OK while there was
  // none. After a failure or a timeout the peers may be anywhere in the op, so
  // the group cannot be trusted again: later collectives fail at once with it.
  absl::Status failure() const;

  // Called once, with the error, when the group first fails (a collective's
  // error or CloseConnections), on the thread that saw it. Set it before any
  // collective.
  void SetFailureListener(std::function<void(const absl::Status&)> listener);

  // Fails the group with `why` (unless it failed already) and, where the
  // backend allows (Gloo), closes its connections at once, so a peer waiting
  // in a collective of this group fails within moments instead of waiting
  // out the timeout. Collectives of this rank in flight on the group may
  // still wait for theirs. Idempotent.
  virtual void CloseConnections(const absl::Status& why);

  // Takes the c10d group of `fresh` (a group just formed over the same ranks
  // in the same positions) in place of this one's, and forgets the failure:
  // whoever holds this Communicator goes on with the new group. The stats
  // carry on. The old group is destroyed on a thread of its own, so Rejoin
  // never waits for the collectives it still runs (abandoned ones end at
  // its timeout). UNIMPLEMENTED for backends that cannot (this base, NCCL);
  // INVALID_ARGUMENT when `fresh` is of another kind, rank or size.
  virtual absl::Status Rejoin(std::unique_ptr<Communicator> fresh);

 protected:
  // Returns `result`, remembering its error if it is the first.
  absl::Status Latch(absl::Status result);
  absl::StatusOr<torch::Tensor> Latch(absl::StatusOr<torch::Tensor> result);
  // Forgets the failure (Rejoin).
  void ClearFailure();
  // Blocks until `done` completes (OK) or the group fails (the failure).
  absl::Status AwaitUnlessFailed(
      const c10::intrusive_ptr<c10::ivalue::Future>& done);

  CommStats stats_;

 private:
  // Wakes the waits of AwaitUnlessFailed; shared with the callbacks of
  // futures that may complete after this Communicator is gone.
  struct Waiters;
  std::shared_ptr<Waiters> waiters_;
  mutable std::mutex failure_mu_;
  absl::Status failure_;
  std::function<void(const absl::Status&)> failure_listener_;
};

// Wraps a c10d group (compat::C10dBackend: Gloo on CPU, or a c10d NCCL
// group). Reduce-scatter uses the backend's op when it has one; otherwise
// (Gloo) an all-reduce of the whole input followed by a local slice: the same
// result, at 2x the bytes of a ring reduce-scatter.
absl::StatusOr<std::unique_ptr<Communicator>> MakeProcessGroupCommunicator(
    c10::intrusive_ptr<compat::C10dBackend> group);

// A Gloo group of `size` ranks over `store` whose connections
// Communicator::CloseConnections can close (ProcessGroupGloo itself cannot: its
// destructor waits for the collectives in flight). Throws as c10d does.
c10::intrusive_ptr<compat::C10dBackend> MakeAbortableGlooGroup(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size,
    std::shared_ptr<gloo::transport::Device> device,
    std::chrono::milliseconds timeout);

// The communicator of one rank over an in-memory store: what the single-rank
// server runs on, so the collective code path is the real one. A Gloo group
// for a CPU `device`; for a CUDA one, an NCCL world of one on device.index()
// (0 when it has none) through MakeCudaCommunicator. INVALID_ARGUMENT naming
// `device` for any other device type.
absl::StatusOr<std::unique_ptr<Communicator>> MakeSingleRankCommunicator(
    torch::Device device = torch::kCPU);

// Device communicators: tally_runtime_nccl (runtime/cuda) makes the NCCL
// communicators of CUDA meshes, and tally_runtime, which must not depend on
// it, reaches it through this factory, which InstallNcclCommunicators() sets.
// Joins the communicator named `prefix` in `store` as `rank` of `size` on
// CUDA device `device`; its calls fail after `timeout`.
using CudaCommunicatorFactory =
    absl::StatusOr<std::unique_ptr<Communicator>> (*)(
        c10::intrusive_ptr<c10d::Store> store, const std::string& prefix,
        int rank, int size, int device, absl::Duration timeout);
void SetCudaCommunicatorFactory(CudaCommunicatorFactory factory);

// OK when collectives can run on `device`: always for a CPU one; for a CUDA
// one when the LibTorch has CUDA (TALLY_TORCH_CUDA) and a CUDA communicator
// factory is installed, FAILED_PRECONDITION naming the missing piece
// otherwise. INVALID_ARGUMENT naming `device` for other device types.
absl::Status CheckCommunicatorDevice(torch::Device device);

// The installed factory's communicator, after CheckCommunicatorDevice(cuda).
absl::StatusOr<std::unique_ptr<Communicator>> MakeCudaCommunicator(
    c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
    int size, int device, absl::Duration timeout);

// Every rank of `group` returns an error if any rank's `local` is one: its own
// (unless it echoes an earlier agreement), or the lowest failing group rank
// r's code with "rank r failed <what>: <its message>". One all-reduce, two more
// broadcasts on a failure; a one-rank or a failed group returns at once, alone.
absl::Status AgreeOnStatus(Communicator& group, absl::Status local,
                           absl::string_view what);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_COMMUNICATOR_H_
