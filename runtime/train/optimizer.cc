#include "runtime/train/optimizer.h"

#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "kernels/fused_optimizer.h"
#include "kernels/grad_stats.h"

namespace tally {
namespace {

// The names of AdamW's state tensors after their parameter's name.
constexpr char kExpAvgSuffix[] = ".exp_avg";
constexpr char kExpAvgSqSuffix[] = ".exp_avg_sq";

}  // namespace

Optimizer::Optimizer(OptimizerKind kind, std::vector<Parameter>* parameters)
    : kind_(kind), parameters_(parameters) {
  Reset();
}

void Optimizer::Reset() {
  step_count_ = 0;
  exp_avg_.clear();
  exp_avg_sq_.clear();
  if (kind_ != OptimizerKind::kAdamW) return;
  torch::NoGradGuard no_grad;
  for (const Parameter& p : *parameters_) {
    // A frozen parameter keeps no moments (undefined placeholders).
    exp_avg_.push_back(p.trainable ? torch::zeros_like(p.tensor)
                                   : torch::Tensor());
    exp_avg_sq_.push_back(p.trainable ? torch::zeros_like(p.tensor)
                                      : torch::Tensor());
  }
}

absl::Status Optimizer::Step(const AdamParams& hp, double grad_scale) {
  const bool adamw = kind_ == OptimizerKind::kAdamW;
  const int64_t step = step_count_ + 1;
  std::vector<kernels::UpdateOperands> fused;
  std::vector<size_t> composed;
  for (size_t i = 0; i < parameters_->size(); ++i) {
    const torch::Tensor& p = (*parameters_)[i].tensor;
    if (!(*parameters_)[i].trainable || !p.grad().defined()) continue;
    kernels::UpdateOperands operands;
    operands.param = p;
    operands.grad = p.grad();
    if (adamw) {
      operands.exp_avg = exp_avg_[i];
      operands.exp_avg_sq = exp_avg_sq_[i];
    }
    const absl::Status fusable = kernels::CheckFusable(operands, adamw);
    if (fusable.ok()) {
      fused.push_back(std::move(operands));
    } else if (absl::IsFailedPrecondition(fusable)) {
      // A device this build cannot step (a CUDA tensor without the CUDA
      // kernels): refused before anything is written.
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot step ", (*parameters_)[i].name, ": ", fusable.message()));
    } else {
      composed.push_back(i);
    }
  }
  kernels::UpdateHyperparameters kernel_hp;
  kernel_hp.learning_rate = hp.learning_rate;
  kernel_hp.beta1 = hp.beta1;
  kernel_hp.beta2 = hp.beta2;
  kernel_hp.eps = hp.eps;
  kernel_hp.weight_decay = hp.weight_decay;
  kernel_hp.step = step;
  kernel_hp.grad_scale = grad_scale;
  const absl::Status fused_step = adamw ? kernels::FusedAdamW(fused, kernel_hp)
                                        : kernels::FusedSgd(fused, kernel_hp);
  // The kernels write through raw pointers: count the writes as an in-place
  // operator would (also after a partial failure), so what keys on the
  // version (a bf16 model's copies, runtime/model/compute_weights.h) sees
  // them.
  for (kernels::UpdateOperands& operands : fused) {
    operands.param.unsafeGetTensorImpl()->bump_version();
  }
  TALLY_RETURN_IF_ERROR(fused_step);
  TALLY_RETURN_IF_ERROR(CatchTorch("optimizer step", [&] {
    torch::NoGradGuard no_grad;
    for (size_t i : composed) StepComposed(i, hp, grad_scale, step);
  }));
  step_count_ = step;
  return CheckWrittenFinite();
}

absl::Status Optimizer::CheckWrittenFinite() const {
  // The parameters only: OptimStep's bound (step_guard.h) keeps the moments
  // finite (each a weighted mean of finite values), and a sweep over them
  // too would cost two more passes over memory per step.
  std::vector<const Parameter*> stepped;
  std::vector<torch::Tensor> tensors;
  for (const Parameter& p : *parameters_) {
    if (p.trainable && p.tensor.grad().defined()) {
      stepped.push_back(&p);
      tensors.push_back(p.tensor);
    }
  }
  bool nonfinite = false;
  TALLY_RETURN_IF_ERROR(CatchTorch("check the step's values", [&] {
    nonfinite = kernels::MultiTensorGradStats(tensors).nonfinite;
  }));
  if (!nonfinite) return absl::OkStatus();
  for (const Parameter* p : stepped) {
    if (!torch::isfinite(p->tensor).all().item<bool>()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the update left non-finite values in ", p->name,
          " (a learning_rate or weight_decay too large for it, or optimizer "
          "state that was not finite before)"));
    }
  }
  return absl::OkStatus();
}

void Optimizer::StepComposed(size_t index, const AdamParams& hp,
                             double grad_scale, int64_t step) {
  torch::Tensor& p = (*parameters_)[index].tensor;
  // Rounded as grad.mul_(grad_scale) would, without modifying the gradient.
  const torch::Tensor grad =
      grad_scale == 1.0 ? p.grad() : p.grad() * grad_scale;
  if (hp.weight_decay != 0) p.mul_(1 - hp.learning_rate * hp.weight_decay);
  if (kind_ == OptimizerKind::kSgd) {
    p.add_(grad, -hp.learning_rate);
    return;
  }
  // The same operation order as torch::optim::AdamW (LibTorch 1.13), so
  // results match it bitwise.
  const double bias_correction1 = 1 - std::pow(hp.beta1, step);
  const double bias_correction2 = 1 - std::pow(hp.beta2, step);
  exp_avg_[index].mul_(hp.beta1).add_(grad, 1 - hp.beta1);
  exp_avg_sq_[index].mul_(hp.beta2).addcmul_(grad, grad, 1 - hp.beta2);
  torch::Tensor denom =
      (exp_avg_sq_[index].sqrt() / std::sqrt(bias_correction2)).add_(hp.eps);
  p.addcdiv_(exp_avg_[index], denom, -hp.learning_rate / bias_correction1);
}

std::vector<std::string> Optimizer::StateSuffixes(OptimizerKind kind) {
  if (kind != OptimizerKind::kAdamW) return {};
  return {kExpAvgSuffix, kExpAvgSqSuffix};
}

std::vector<std::pair<std::string, torch::Tensor>> Optimizer::StateTensors()
    const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t i = 0; i < exp_avg_.size(); ++i) {
    if (!exp_avg_[i].defined()) continue;  // frozen
    const std::string& name = (*parameters_)[i].name;
    out.emplace_back(name + kExpAvgSuffix, exp_avg_[i]);
    out.emplace_back(name + kExpAvgSqSuffix, exp_avg_sq_[i]);
  }
  return out;
}

absl::Status Optimizer::LoadState(
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    int64_t step_count) {
  if (step_count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer step count must be >= 0, got ", step_count));
  }
  std::vector<torch::Tensor> exp_avg, exp_avg_sq;
  auto find = [&](const std::string& name,
                  const torch::Tensor& like) -> absl::StatusOr<torch::Tensor> {
    for (const auto& [n, t] : tensors) {
      if (n != name) continue;
      if (t.sizes() != like.sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state ", name, " has shape ", c10::str(t.sizes()),
            ", expected ", c10::str(like.sizes())));
      }
      torch::Tensor value = t.to(like.device(), like.scalar_type()).clone();
      // A moment a hostile or damaged file made non-finite (or a negative
      // second moment, whose square root is NaN) would stop the parameter
      // from ever training again: refused before anything changes.
      if (!torch::isfinite(value).all().item<bool>()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state ", name, " holds a non-finite value"));
      }
      if (absl::EndsWith(name, kExpAvgSqSuffix) &&
          (value < 0).any().item<bool>()) {
        return absl::InvalidArgumentError(
            absl::StrCat("optimizer state ", name, " holds a negative value"));
      }
      return value;
    }
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state ", name, " is missing"));
  };
  if (kind_ == OptimizerKind::kAdamW) {
    for (const Parameter& p : *parameters_) {
      if (!p.trainable) {
        exp_avg.emplace_back();
        exp_avg_sq.emplace_back();
        continue;
      }
      TALLY_ASSIGN_OR_RETURN(torch::Tensor m,
                             find(p.name + kExpAvgSuffix, p.tensor));
      TALLY_ASSIGN_OR_RETURN(torch::Tensor v,
                             find(p.name + kExpAvgSqSuffix, p.tensor));
      exp_avg.push_back(std::move(m));
      exp_avg_sq.push_back(std::move(v));
    }
  }
  exp_avg_ = std::move(exp_avg);
  exp_avg_sq_ = std::move(exp_avg_sq);
  step_count_ = step_count;
  return absl::OkStatus();
}

absl::Status ValidateAdamParams(const AdamParams& hp,
                                const std::string& prefix) {
  auto bad = [&](const char* field, double value, const char* rule) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ".", field, " must be ", rule, ", got ", value));
  };
  if (!std::isfinite(hp.learning_rate) || hp.learning_rate < 0) {
    return bad("learning_rate", hp.learning_rate, "finite and >= 0");
  }
  if (!(hp.beta1 >= 0 && hp.beta1 < 1))
    return bad("beta1", hp.beta1, "in [0, 1)");
  if (!(hp.beta2 >= 0 && hp.beta2 < 1))
    return bad("beta2", hp.beta2, "in [0, 1)");
  if (!std::isfinite(hp.eps) || hp.eps <= 0) {
    return bad("eps", hp.eps, "finite and > 0");
  }
  if (!std::isfinite(hp.weight_decay) || hp.weight_decay < 0) {
    return bad("weight_decay", hp.weight_decay, "finite and >= 0");
  }
  return absl::OkStatus();
}

}  // namespace tally
