#include "runtime/grad_norm.h"

#include <cmath>
#include <limits>

#include "kernels/grad_stats.h"
#include "runtime/status.h"

namespace tally {
namespace {

// Non-finite severity, reduced with the INF norm (MAX keeps the worst).
constexpr double kSawInf = 1.0;
constexpr double kSawNan = 2.0;

double NonFiniteCode(const kernels::GradStats& stats) {
  if (!stats.nonfinite) return 0.0;
  return std::isnan(stats.sum_squares) ? kSawNan : kSawInf;
}

}  // namespace

absl::StatusOr<GradNorm> ComputeGlobalGradNorm(
    const std::vector<Parameter>& parameters, const Mesh& mesh,
    Communicator& world, NormType type) {
  std::vector<torch::Tensor> dense, expert;
  for (const Parameter& p : parameters) {
    const torch::Tensor& grad = p.tensor.grad();
    if (!grad.defined() || !p.placements.IsCanonicalReplica(mesh)) continue;
    (p.is_expert ? expert : dense).push_back(grad);
  }
  TALLY_ASSIGN_OR_RETURN(
      torch::Tensor slots,
      CatchTorch("grad stats", [&]() -> absl::StatusOr<torch::Tensor> {
        kernels::GradStats d = kernels::MultiTensorGradStats(dense);
        kernels::GradStats e = kernels::MultiTensorGradStats(expert);
        const double code = std::max(NonFiniteCode(d), NonFiniteCode(e));
        if (type == NormType::kInf) {
          return torch::tensor({d.max_abs, e.max_abs, code}, torch::kFloat64);
        }
        return torch::tensor({d.sum_squares, e.sum_squares, code},
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
  // A backend's MAX may drop NaN (SUM propagates it on its own); the reduced
  // code restores it so every rank sees the same non-finite value.
  if (type == NormType::kInf && values[2] > 0) {
    norm.total = values[2] >= kSawNan
                     ? std::numeric_limits<double>::quiet_NaN()
                     : std::numeric_limits<double>::infinity();
  }
  return norm;
}

}  // namespace tally
