#include "runtime/parallel/grad_norm.h"

#include <cmath>
#include <limits>

#include "base/status.h"
#include "kernels/grad_stats.h"

namespace tally {

absl::StatusOr<GradNorm> ComputeGlobalGradNorm(
    const std::vector<Parameter>& parameters, const Mesh& mesh,
    Communicator& world, NormType type) {
  std::vector<torch::Tensor> dense, expert, replicas;
  for (const Parameter& p : parameters) {
    const torch::Tensor& grad = p.tensor.grad();
    if (!p.trainable || !grad.defined()) continue;
    if (!p.placements.IsCanonicalReplica(mesh)) {
      replicas.push_back(grad);
    } else {
      (p.is_expert ? expert : dense).push_back(grad);
    }
  }
  // Slots: [dense, expert] squares (L2) or max |g| (INF), then the NaN and
  // Inf flags. Replicas the norm does not count still report non-finite
  // values, so a NaN on any rank makes every rank skip.
  TALLY_ASSIGN_OR_RETURN(
      torch::Tensor slots,
      CatchTorch("grad stats", [&]() -> absl::StatusOr<torch::Tensor> {
        const kernels::GradStats d = kernels::MultiTensorGradStats(dense);
        const kernels::GradStats e = kernels::MultiTensorGradStats(expert);
        const kernels::GradStats r = kernels::MultiTensorGradStats(replicas);
        double saw_nan = 0, saw_inf = 0;
        for (const kernels::GradStats* s : {&d, &e, &r}) {
          if (!s->nonfinite) continue;
          (std::isnan(s->max_abs) ? saw_nan : saw_inf) = 1;
        }
        if (type == NormType::kInf) {
          return torch::tensor({d.max_abs, e.max_abs, saw_nan, saw_inf},
                               torch::kFloat64);
        }
        return torch::tensor({d.sum_squares, e.sum_squares, saw_nan, saw_inf},
                             torch::kFloat64);
      }));
  TALLY_RETURN_IF_ERROR(world.AllReduce(
      slots, type == NormType::kInf ? ReduceOp::kMax : ReduceOp::kSum));

  auto values = slots.accessor<double, 1>();
  GradNorm norm;
  if (type == NormType::kInf) {
    norm.dense = values[0];
    norm.expert = values[1];
    norm.total = std::max(values[0], values[1]);
  } else {
    norm.dense = std::sqrt(values[0]);
    norm.expert = std::sqrt(values[1]);
    norm.total = std::sqrt(values[0] + values[1]);
  }
  // The flags decide, not the reduced values: a backend's MAX may drop NaN.
  if (values[2] > 0) {
    norm.total = std::numeric_limits<double>::quiet_NaN();
  } else if (values[3] > 0) {
    norm.total = std::numeric_limits<double>::infinity();
  }
  return norm;
}

}  // namespace tally
