// Optimizer: AdamW (torch.optim.AdamW semantics) and SGD over the local
// shards of a model's parameters.
//
// Step() reads every gradient as grad * grad_scale (OptimStep passes
// clip_coef / normalizer, so the raw accumulated sums are normalized and
// clipped on the fly) and applies one update with the hyperparameters given
// for this step, so every field a client sends is honored. Contiguous
// float32 / float64 parameters go through the fused kernels
// (kernels/fused_optimizer.h), one pass over memory: on the CPU, or on a
// CUDA device in one launch per dtype; any other parameter takes the
// composed LibTorch ops, with the same arithmetic. State (moments and the
// step count used for bias correction) lives on each parameter's device and
// exists only for the local shards of trainable parameters; frozen ones are
// never stepped.
//
//   tally::Optimizer opt(tally::OptimizerKind::kAdamW, &model->parameters());
//   TALLY_RETURN_IF_ERROR(opt.Step(params, clip.grad_scale));
//   for (const auto& [name, t] : opt.StateTensors()) Save(name, t);
#ifndef TALLY_RUNTIME_TRAIN_OPTIMIZER_H_
#define TALLY_RUNTIME_TRAIN_OPTIMIZER_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "runtime/config/types.h"
#include "runtime/parallel/parameter.h"

namespace tally {

class Optimizer {
 public:
  // `parameters` must outlive the optimizer.
  Optimizer(OptimizerKind kind, std::vector<Parameter>* parameters);

  OptimizerKind kind() const { return kind_; }
  // Number of updates applied (AdamW bias correction uses it).
  int64_t step_count() const { return step_count_; }

  // Gradients are only read: they keep their raw values. Then one sweep
  // over the parameters the update wrote: FAILED_PRECONDITION naming the
  // first one it left non-finite (the update is applied: the caller treats
  // the parameters as damaged). OptimStep refuses the updates whose
  // gradients could overflow (the moments included) before this
  // (step_guard.h). FAILED_PRECONDITION, before anything is written, for a
  // parameter on a device this build cannot step (a CUDA tensor without the
  // CUDA kernels: kernels::CudaTensorSupport).
  absl::Status Step(const AdamParams& params, double grad_scale = 1.0);

  // Moments start again from zero and the step count from 0.
  void Reset();

  // The state tensors of each trainable parameter, named by suffix:
  // {".exp_avg", ".exp_avg_sq"} for AdamW, none for SGD.
  static std::vector<std::string> StateSuffixes(OptimizerKind kind);
  // "<param name><suffix>" for every trainable parameter and StateSuffixes
  // entry. The tensors alias the live state.
  std::vector<std::pair<std::string, torch::Tensor>> StateTensors() const;
  // Replaces the state from tensors named as StateTensors() names them,
  // copied to each parameter's dtype and device; INVALID_ARGUMENT naming the
  // tensor when one is missing, misshaped, non-finite or (a second moment)
  // negative, and then the state is unchanged.
  absl::Status LoadState(
      const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
      int64_t step_count);

 private:
  // Step's sweep over what the update wrote.
  absl::Status CheckWrittenFinite() const;
  // The composed LibTorch ops, for a parameter the fused kernels refuse.
  void StepComposed(size_t index, const AdamParams& hp, double grad_scale,
                    int64_t step);

  OptimizerKind kind_;
  std::vector<Parameter>* parameters_;
  std::vector<torch::Tensor> exp_avg_;
  std::vector<torch::Tensor> exp_avg_sq_;
  int64_t step_count_ = 0;
};

// INVALID_ARGUMENT naming `<field_prefix>.<field>` for hyperparameters that
// cannot be applied (negative or non-finite lr, betas outside [0, 1), ...).
absl::Status ValidateAdamParams(const AdamParams& params,
                                const std::string& field_prefix);

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_OPTIMIZER_H_
