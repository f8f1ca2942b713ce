// Bucketed gradient all-reduce: the data-parallel gradient sum with one
// collective per flat bucket instead of one per parameter, either after
// backward (AllReduceGradientsInBuckets) or launched from gradient hooks
// while backward still runs (OverlappedGradientSum).
//
// The gradients of one dtype are laid end to end in REVERSE parameter order
// (the order backward produces them, so the first bucket is ready first) and
// cut into buckets of `bucket_bytes`; each bucket is copied into a flat
// buffer, all-reduced (SUM) and copied back. A gradient may straddle two
// buckets, so a sync issues exactly ceil(bytes / bucket_bytes) all-reduces
// per dtype, and every element is summed exactly as a per-parameter
// all-reduce sums it. Both ways lay out and sum the same buckets, so their
// results are bitwise identical.
//
//   TALLY_RETURN_IF_ERROR(tally::AllReduceGradientsInBuckets(
//       model.parameters(), *groups.dp_replicate, int64_t{25} << 20));
//
//   // Overlapped: hooks are registered at Create, launch only once armed.
//   TALLY_ASSIGN_OR_RETURN(auto sum, tally::OverlappedGradientSum::Create(
//       {{groups.dp_replicate, model.parameters()}}, int64_t{25} << 20));
//   sum->Arm();
//   loss.backward();  // buckets launch as their gradients are accumulated
//   TALLY_RETURN_IF_ERROR(sum->Finish());
#ifndef TALLY_RUNTIME_PARALLEL_GRAD_BUCKETS_H_
#define TALLY_RUNTIME_PARALLEL_GRAD_BUCKETS_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/parameter.h"

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace tally {
namespace grad_buckets_internal {
struct Bucket;
struct InFlight;
}  // namespace grad_buckets_internal

// Sums every defined `.grad` of `parameters` over `group` in place (an
// undefined gradient takes no part, so every rank must have the same ones
// defined). INVALID_ARGUMENT for bucket_bytes < 1; a collective's error is
// returned as is, with the gradients of unfinished buckets unspecified.
absl::Status AllReduceGradientsInBuckets(std::vector<Parameter>& parameters,
                                         Communicator& group,
                                         int64_t bucket_bytes);

// Parameters whose gradients sum over `group`. Copies of a Parameter share
// its tensor, so sums land in the caller's parameters.
struct GradientSet {
  Communicator* group = nullptr;
  std::vector<Parameter> parameters;
};

// AllReduceGradientsInBuckets of every set, with the all-reduces launched
// during one backward pass: a post hook on each parameter's gradient
// accumulator (the AccumulateGrad node, as c10d's DDP Reducer does) marks
// the gradient final, and a bucket whose gradients are all final is packed
// and started with AllReduceAsync. Buckets start strictly in layout order
// per communicator, so every rank issues the same collectives in the same
// order however its hooks are ordered. Finish() starts the rest (those of
// parameters that got no gradient, laid out without them as
// AllReduceGradientsInBuckets would), waits and copies the sums back.
//
// Only the armed backward pass launches anything: arm right before the last
// backward of a step, so earlier ones just accumulate. Each launched bucket
// keeps its own buffer until Finish (up to one extra copy of the gradients).
// Hooks run on the thread that runs backward (for CPU tensors, the caller).
class OverlappedGradientSum {
 public:
  // Registers the hooks (removed by the destructor). INVALID_ARGUMENT for
  // bucket_bytes < 1 or a set without a group; a parameter that is not a
  // leaf is an error too.
  static absl::StatusOr<std::unique_ptr<OverlappedGradientSum>> Create(
      std::vector<GradientSet> sets, int64_t bucket_bytes);
  // Unless Finish was called (a failed step), first starts every planned
  // bucket not yet started, with zeros for missing gradients, and waits for
  // all: every rank that gives up the same way issues the same collectives,
  // so the groups stay usable. Nothing is copied back. The waits on a group
  // that failed (closed by a rank that failed fast) return at once.
  ~OverlappedGradientSum();
  OverlappedGradientSum(const OverlappedGradientSum&) = delete;
  OverlappedGradientSum& operator=(const OverlappedGradientSum&) = delete;

  // From now on, a gradient accumulation may start buckets.
  void Arm();
  // Disarms, starts the remaining buckets, waits for all and writes the sums
  // into `.grad`. Call once, after the armed backward. On error the
  // gradients are unspecified.
  absl::Status Finish();

  // How many all-reduces the hooks started (before Finish).
  int64_t started_by_hooks() const;

 private:
  using Bucket = grad_buckets_internal::Bucket;
  using InFlight = grad_buckets_internal::InFlight;
  // The buckets of one communicator's sets, in the order they start.
  struct Sequence {
    Communicator* group;
    std::vector<std::pair<size_t, size_t>> order;  // (set, planned bucket)
    size_t next = 0;                               // the first not started
  };
  struct Hook {
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t key;
  };

  OverlappedGradientSum(std::vector<GradientSet> sets, int64_t bucket_bytes);
  // Registers the hooks and lays out the buckets.
  void Prepare();
  // The hook of parameter `param` of set `set`.
  void OnGradientAccumulated(size_t set, size_t param);
  // Packs `bucket` from set `set`'s current gradients (zeros where none)
  // and starts its all-reduce. Requires mu_.
  void Start(size_t set, const Bucket& bucket);
  // Starts, sequence by sequence, every bucket of `plans` (per set, in
  // order) that the hooks did not.
  void StartRemaining(const std::vector<std::vector<Bucket>>& plans);
  // Waits for every started all-reduce; the first error, if any.
  absl::Status WaitForAll();

  std::vector<GradientSet> sets_;
  const int64_t bucket_bytes_;
  std::vector<Hook> hooks_;
  // Per set: the buckets laid out as if every parameter that requires grad
  // gets a gradient; per parameter the planned buckets holding a piece of
  // it; per planned bucket its parameters not accumulated yet.
  std::vector<std::vector<Bucket>> planned_;
  std::vector<std::vector<std::vector<size_t>>> buckets_of_;
  std::vector<std::vector<int>> unready_;
  std::vector<std::vector<bool>> accumulated_;
  std::vector<Sequence> sequences_;
  std::vector<size_t> sequence_of_;  // per set

  mutable std::mutex mu_;
  bool armed_ = false;
  bool finished_ = false;  // every bucket was started (or none may be)
  int64_t started_by_hooks_ = 0;
  absl::Status hook_error_;  // the first error a hook ran into
  std::vector<InFlight> in_flight_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_GRAD_BUCKETS_H_
