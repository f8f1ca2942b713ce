// The operand and result types of the tensor-level kernel entries:
// UpdateOperands (FusedAdamW / FusedSgd, kernels/fused_optimizer.h) and
// GradStats (MultiTensorGradStats, kernels/grad_stats.h). In a header of
// their own because those entries send CUDA tensors to kernels/cuda_tensors.h,
// which takes and returns the same types: it includes this, not them.
//
//   std::vector<tally::kernels::UpdateOperands> tensors = {
//       {param, param.grad(), exp_avg, exp_avg_sq}};
//   tally::kernels::GradStats stats = tally::kernels::MultiTensorGradStats(
//       {param.grad()});
#ifndef TALLY_KERNELS_TENSOR_OPERANDS_H_
#define TALLY_KERNELS_TENSOR_OPERANDS_H_

#include <torch/torch.h>

namespace tally::kernels {

// One parameter's operands. For SGD the moments stay undefined.
struct UpdateOperands {
  torch::Tensor param;
  torch::Tensor grad;
  torch::Tensor exp_avg;
  torch::Tensor exp_avg_sq;
};

struct GradStats {
  double sum_squares = 0.0;  // NaN if any element is NaN
  double max_abs = 0.0;      // NaN if any element is NaN
  bool nonfinite = false;    // any NaN or Inf element
};

}  // namespace tally::kernels

#endif  // TALLY_KERNELS_TENSOR_OPERANDS_H_
