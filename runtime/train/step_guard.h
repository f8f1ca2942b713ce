// StepGuard: the check OptimStep makes before an update so that the update
// cannot write a non-finite value into the parameters or the optimizer
// state (docs/reliability.md, "What a step writes").
//
// The global gradient norm every rank already agreed on bounds every element
// the update reads: |g_i| * clip_coef <= norm * clip_coef for the L2 and the
// inf norm. From that bound alone (no pass over the tensors, no collective,
// the same verdict on every rank) a step is refused when the bound is not
// finite, when its square would overflow AdamW's second moment, or when the
// learning rate times it would overflow SGD's update, in the dtype the
// update is computed in (the master dtype), with a factor of two to spare
// for the moments' sums. What such a bound cannot foresee (an absurd
// learning rate on AdamW) Optimizer::Step finds after the update, in one
// sweep over what it wrote.
//
//   const std::optional<std::string> unsafe =
//       tally::UnsafeStepReason(clip, hp, spec.optimizer, spec.dtype);
//   if (unsafe) ... refuse (NonFinitePolicy::kError) or skip the step
#ifndef TALLY_RUNTIME_TRAIN_STEP_GUARD_H_
#define TALLY_RUNTIME_TRAIN_STEP_GUARD_H_

#include <optional>
#include <string>

#include "runtime/config/types.h"
#include "runtime/train/accumulation.h"

namespace tally {

// Why a step with `clip`, `hp` and `optimizer` on a model of `dtype` could
// write a non-finite value (a sentence naming the norm and the limit it
// passes), or nullopt when it cannot through its gradients.
std::optional<std::string> UnsafeStepReason(const ClipResult& clip,
                                            const AdamParams& hp,
                                            OptimizerKind optimizer,
                                            DType dtype);

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_STEP_GUARD_H_
