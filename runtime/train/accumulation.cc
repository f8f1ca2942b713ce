#include "runtime/train/accumulation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace tally {

absl::Status AccumulationWindow::CheckReduction(LossReduction reduction) const {
  if (counts_.reduction && *counts_.reduction != reduction) {
    return absl::FailedPreconditionError(
        absl::StrCat("reduction ", ReductionName(reduction),
                     " differs from the pending window's ",
                     ReductionName(*counts_.reduction), " (", counts_.calls,
                     " calls); call OptimStep or AbortAccumulation first"));
  }
  return absl::OkStatus();
}

void AccumulationWindow::Add(LossReduction reduction, int64_t tokens,
                             int64_t samples) {
  counts_.reduction = reduction;
  ++counts_.calls;
  counts_.tokens += tokens;
  counts_.samples += samples;
}

double AccumulationWindow::Normalizer() const {
  if (!counts_.reduction || counts_.tokens == 0) return 0.0;
  switch (*counts_.reduction) {
    case LossReduction::kTokenMean:
      return static_cast<double>(counts_.tokens);
    case LossReduction::kSampleMean:
      return static_cast<double>(counts_.samples);
    case LossReduction::kSum:
      return 1.0;
  }
  return 0.0;
}

absl::StatusOr<ClipResult> ComputeClip(const std::vector<Parameter>& parameters,
                                       double normalizer, const Mesh& mesh,
                                       Communicator& world, NormType norm_type,
                                       double max_grad_norm) {
  if (!(normalizer > 0)) {
    return absl::FailedPreconditionError("normalizer must be > 0");
  }
  TALLY_ASSIGN_OR_RETURN(
      GradNorm raw, ComputeGlobalGradNorm(parameters, mesh, world, norm_type));
  // ||g / N|| = ||g|| / N: the raw gradients are measured, never rewritten.
  ClipResult result;
  result.norm = {raw.total / normalizer, raw.dense / normalizer,
                 raw.expert / normalizer};
  if (!std::isfinite(result.norm.total)) return result;
  if (max_grad_norm > 0) {
    result.clip_coef =
        std::min(1.0, max_grad_norm / (result.norm.total + 1e-6));
  }
  result.grad_scale = result.clip_coef / normalizer;
  return result;
}

absl::StatusOr<ClipResult> NormalizeAndClip(std::vector<Parameter>& parameters,
                                            double normalizer, const Mesh& mesh,
                                            Communicator& world,
                                            NormType norm_type,
                                            double max_grad_norm) {
  TALLY_ASSIGN_OR_RETURN(ClipResult result,
                         ComputeClip(parameters, normalizer, mesh, world,
                                     norm_type, max_grad_norm));
  if (!std::isfinite(result.norm.total)) return result;
  TALLY_RETURN_IF_ERROR(CatchTorch("normalize gradients", [&] {
    torch::NoGradGuard no_grad;
    for (Parameter& p : parameters) {
      if (p.tensor.grad().defined()) {
        p.tensor.mutable_grad().mul_(result.grad_scale);
      }
    }
  }));
  return result;
}

void ZeroGradients(std::vector<Parameter>& parameters) {
  torch::NoGradGuard no_grad;
  for (Parameter& p : parameters) {
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().zero_();
    // ZeRO-1's whole gradient, not yet reduced into the shard's.
    if (p.gathered != nullptr && p.gathered->grad.defined()) {
      p.gathered->grad.zero_();
    }
  }
}

}  // namespace tally
