// The pass of one ForwardBackward call over a built model on this rank: the
// call's samples planned into this rank's micro-batches
// (runtime/train/call_plan.h), run through the stage schedule
// (runtime/parallel/pipeline_executor.h) with this stage's forward — the hidden
// states and the model's auxiliary-loss channels flow between stages, the loss
// is computed on the last one — the per-sample results summed over the ranks,
// and, when the call sums its own gradients, the model's GradientSync for the
// call. The engine validates the call before and keeps the window; the pass
// changes only the gradients.
//
//   TALLY_RETURN_IF_ERROR(
//       tally::CheckAuxiliaryLossesApply(built.model(), args));
//   tally::PassOptions options;
//   options.sum_call_gradients = true;  // EAGER
//   TALLY_ASSIGN_OR_RETURN(
//       tally::ForwardBackwardResult result,
//       tally::RunForwardBackwardPass(built, args, *loss, options));
#ifndef TALLY_RUNTIME_ENGINE_FORWARD_BACKWARD_H_
#define TALLY_RUNTIME_ENGINE_FORWARD_BACKWARD_H_

#include <torch/torch.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/config/types.h"
#include "runtime/engine/built_model.h"
#include "runtime/model/causal_lm.h"
#include "runtime/train/token_loss.h"

namespace tally {

// A model's auxiliary losses (MoE load balancing) join each token's loss as
// a term of its log-probability, weighted like cross-entropy: exact for
// cross-entropy with weights >= 0. The policy losses would take the term
// into their importance ratio, and a negative weight would flip its sign:
// INVALID_ARGUMENT naming the field.
absl::Status CheckAuxiliaryLossesApply(const CausalLm& model,
                                       const ForwardBackwardArgs& args);

struct PassOptions {
  // Where the model lives: micro-batches are moved there.
  torch::Device device = torch::kCPU;
  // Padded tokens per micro-batch.
  int64_t max_batch_tokens = 16384;
  // Under pipeline parallelism: how many parts each data rank's samples are
  // split into; 0 means the number of stages.
  int pp_microbatches = 0;
  // Start the replica sums from gradient hooks during the last backward.
  bool overlap_grad_sync = true;
  // The call's gradients are summed across ranks on their own when it ends
  // (EAGER, or a DEFERRED window already summed), where the model needs a
  // sum at all (GradientSync::needed).
  bool sum_call_gradients = false;
};

// Runs the call (validated by the caller; `loss` is the one args.loss
// describes) and returns its results, with the same numbers on every rank;
// result.window is left for the caller. A failure may come after some
// micro-batches added their gradients.
absl::StatusOr<ForwardBackwardResult> RunForwardBackwardPass(
    BuiltModel& built, const ForwardBackwardArgs& args, const TokenLoss& loss,
    const PassOptions& options);

}  // namespace tally

#endif  // TALLY_RUNTIME_ENGINE_FORWARD_BACKWARD_H_
