// GradientSync: how a built model's gradients are summed across ranks before
// a step, decided once when the model is built from its parameters and this
// rank's groups, never again per call:
//   - ZeRO-1 (runtime/parallel/zero.h): the whole gradients are
//     reduce-scattered into the dp_shard shards first;
//   - the replica sums: dense gradients over groups.replicas (dp_replicate x
//     cp), expert ones over groups.expert_replicas, each set in flat buckets
//     (runtime/parallel/grad_buckets.h), only where the group has more than one
//     rank and the set a trainable parameter;
//   - the tied embedding's two copies on the first and last pipeline stage.
// A window sums either per call (EAGER: CallGradientSum, whose replica sums
// may start during the call's last backward) or once at OptimStep (DEFERRED:
// SumAccumulated).
//
//   tally::GradientSync sync(model, groups, /*bucket_bytes=*/25 << 20);
//   if (sync.needed()) {
//     TALLY_ASSIGN_OR_RETURN(auto call, sync.BeginCall(/*overlap=*/true));
//     ... forwards and backwards; call->ArmForLastBackward() before the last
//     TALLY_RETURN_IF_ERROR(call->Finish());
//   }
//   // or, DEFERRED, at OptimStep:
//   TALLY_RETURN_IF_ERROR(sync.SumAccumulated());
#ifndef TALLY_RUNTIME_TRAIN_GRADIENT_SYNC_H_
#define TALLY_RUNTIME_TRAIN_GRADIENT_SYNC_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/model/causal_lm.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/engine_groups.h"
#include "runtime/parallel/grad_buckets.h"
#include "runtime/parallel/parameter.h"

namespace tally {

class CallGradientSum;

class GradientSync {
 public:
  // Decides from `model` as built (which parameters train, which are
  // experts, its ZeRO stage and pipeline stage) and this rank's `groups`;
  // both outlive this. `bucket_bytes`: the size of a flat bucket of the
  // replica sums.
  GradientSync(CausalLm& model, const EngineGroups& groups,
               int64_t bucket_bytes);

  // Whether gradients must be summed across ranks before a step.
  bool needed() const { return needed_; }
  // ZeRO-1: the whole gradients are reduce-scattered over dp_shard first.
  bool reduces_whole_gradients() const { return whole_gradients_; }
  // The replica sums, in order: dense, then expert.
  const std::vector<GradientSet>& replica_sets() const { return replica_sets_; }
  // This stage's copy of the tied embedding whose gradient sums with the
  // other end stage's; nullptr when none.
  const Parameter* tied_embedding() const { return tied_; }

  // Sums every gradient accumulated so far (a DEFERRED window at OptimStep);
  // OK at once when nothing is needed. A collective's error is returned as
  // is, with the gradients partly summed.
  absl::Status SumAccumulated();
  // Sets the gradients accumulated so far aside, so that the call about to
  // run fills empty ones, which its Finish sums before adding the earlier
  // ones back (EAGER, or a DEFERRED window already summed). With `overlap`,
  // the replica sums start from gradient hooks during the call's last
  // backward (not under ZeRO-1, whose shards get their gradients after
  // backward). Requires needed().
  absl::StatusOr<std::unique_ptr<CallGradientSum>> BeginCall(bool overlap);

 private:
  friend class CallGradientSum;

  // ZeRO-1's reduction, the replica sums (through `overlapped`, when set),
  // then the tied embedding's.
  absl::Status Sum(OverlappedGradientSum* overlapped);
  absl::Status SumTiedEmbedding();

  CausalLm& model_;
  Communicator& dp_shard_;
  Communicator& pp_;
  const int64_t bucket_bytes_;
  bool whole_gradients_ = false;
  std::vector<GradientSet> replica_sets_;
  Parameter* tied_ = nullptr;
  bool needed_ = false;
};

// The sum of one call's gradients, begun by GradientSync::BeginCall.
class CallGradientSum {
 public:
  // The groups whose sums start during the last backward (empty without
  // overlap): their ranks must agree to go on before that backward, so that
  // none starts a sum that a failed replica would not join.
  const std::vector<Communicator*>& overlapped_groups() const {
    return overlapped_groups_;
  }
  // Right before the call's last backward: its gradient hooks start the
  // replica sums from then on (nothing without overlap).
  void ArmForLastBackward();
  // Sums the call's gradients and adds the earlier ones back to them.
  absl::Status Finish();

 private:
  friend class GradientSync;
  explicit CallGradientSum(GradientSync& sync) : sync_(sync) {}

  GradientSync& sync_;
  std::vector<torch::Tensor> earlier_;
  std::unique_ptr<OverlappedGradientSum> overlapped_;
  std::vector<Communicator*> overlapped_groups_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_GRADIENT_SYNC_H_
