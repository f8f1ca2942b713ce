// Fused optimizer updates over many tensors: one pass per element that
// reads the raw gradient, applies the step's gradient scale (clip_coef /
// normalizer) and updates the parameter and, for AdamW, both moments. CPU
// tensors go to the CPU kernels below; CUDA tensors to the CUDA kernels
// (kernels/cuda_tensors.h: one launch per dtype on the device's current
// stream), in builds that have them.
//
// The arithmetic (kernels/optimizer_math.h) is that of the composed LibTorch
// path, operation for operation: `grad.mul_(scale)` followed by
// torch::optim::AdamW or by `p.mul_(1 - lr * wd).add_(grad, -lr)` for SGD.
// On an x86-64 CPU with AVX2 + FMA (where ATen runs its AVX2 kernels) the
// results are bitwise those of the composed path; elsewhere they may differ
// by an ulp per operation. Gradients are only read: they stay raw (unscaled).
//
// Every element is independent, so results do not depend on the thread
// count; work is split into fixed-size chunks over at::parallel_for.
//
//   tally::kernels::UpdateHyperparameters hp;
//   hp.learning_rate = 1e-3;
//   hp.step = 1;
//   hp.grad_scale = clip_coef / num_tokens;
//   std::vector<tally::kernels::UpdateOperands> tensors = {
//       {param, param.grad(), exp_avg, exp_avg_sq}};
//   TALLY_RETURN_IF_ERROR(tally::kernels::FusedAdamW(tensors, hp));
#ifndef TALLY_KERNELS_FUSED_OPTIMIZER_H_
#define TALLY_KERNELS_FUSED_OPTIMIZER_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/optimizer_math.h"
#include "kernels/tensor_operands.h"

namespace tally::kernels {

// OK when the fused kernels can update `tensors`: every defined operand is a
// contiguous tensor of the parameter's dtype (float32 or float64), shape and
// device (cpu or cuda), and the moments are defined exactly when
// `with_moments`. INVALID_ARGUMENT naming the operand otherwise, and
// FAILED_PRECONDITION saying why for a CUDA parameter this build cannot
// update (kernels::CudaTensorSupport).
absl::Status CheckFusable(const UpdateOperands& tensors, bool with_moments);

// Applies one AdamW update to every entry. Checks every entry first
// (CheckFusable, prefixed with "tensors[i]") and changes nothing if one fails;
// INVALID_ARGUMENT when the entries' params are on different devices. On
// CUDA the update is queued on the current stream when this returns.
absl::Status FusedAdamW(const std::vector<UpdateOperands>& tensors,
                        const UpdateHyperparameters& hp);

// Applies one SGD update (decoupled weight decay, then -lr * scaled grad);
// only learning_rate, weight_decay and grad_scale of `hp` are used, and the
// moments of every entry must be undefined.
absl::Status FusedSgd(const std::vector<UpdateOperands>& tensors,
                      const UpdateHyperparameters& hp);

}  // namespace tally::kernels

#endif  // TALLY_KERNELS_FUSED_OPTIMIZER_H_
