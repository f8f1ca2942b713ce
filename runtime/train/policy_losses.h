// Policy-gradient losses: Tinker's importance_sampling, ppo, cispo and dro,
// per token, on the sampler's tokens.
//
// Each reads a token's advantage A and the log-probability q the sampler gave
// it (Sample::token_inputs kAdvantages, kSamplingLogprobs) beside the
// trainer's log-probability logp, with ratio = exp(logp - q):
//   importance_sampling  -ratio * A
//   ppo                  -min(ratio * A, clip(ratio, low, high) * A)
//   cispo                -stop_gradient(clip(ratio, low, high)) * logp * A
//   dro                  -(logp * A - beta / 2 * (logp - q)^2)
// Like every TokenLoss, ComputeLoss weights each valid token's term by w and
// sums it raw, so the window's reduction normalizes it once at OptimStep.
//
//   const tally::PpoLoss ppo(tally::ClipRange{0.8, 1.28});
//   tally::LossTerms terms = tally::ComputeLoss(ppo, logprobs, batch,
//   reduction);
// A ForwardBackward names them by name (the loss table: loss_id.h).
#ifndef TALLY_RUNTIME_TRAIN_POLICY_LOSSES_H_
#define TALLY_RUNTIME_TRAIN_POLICY_LOSSES_H_

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/train/token_loss.h"

namespace tally {

// The largest log importance ratio the losses use: ratios above e^60
// (~1e26; a sampler log-probability far below the trainer's, e.g. a
// sentinel) are capped there.
inline constexpr double kMaxLogRatio = 60.0;

// A loss of the trainer's and the sampler's log-probabilities and the
// advantages, which every sample must carry.
class PolicyLoss : public TokenLoss {
 public:
  std::vector<std::string> required_inputs() const override {
    return {kAdvantages, kSamplingLogprobs};
  }
  torch::Tensor TokenLosses(const torch::Tensor& target_logprobs,
                            const PackedBatch& batch) const final;

 protected:
  // The valid tokens' values; 0 elsewhere, so nothing there is non-finite.
  struct Terms {
    torch::Tensor logprobs;    // logp, differentiable
    torch::Tensor advantages;  // A
    torch::Tensor log_ratio;   // logp - q, differentiable
    torch::Tensor ratio;       // exp(logp - q), differentiable
  };
  // The per-token loss before weighting.
  virtual torch::Tensor Loss(const Terms& terms) const = 0;
};

// The bounds PPO and CISPO clip the ratio to (loss_fn_config
// clip_low_threshold and clip_high_threshold).
struct ClipRange {
  double low = 0.8;
  double high = 1.2;
};

class ImportanceSamplingLoss final : public PolicyLoss {
 public:
  std::string name() const override {
    return LossName(LossId::kImportanceSampling);
  }

 private:
  torch::Tensor Loss(const Terms& terms) const override;
};

class PpoLoss final : public PolicyLoss {
 public:
  explicit PpoLoss(ClipRange clip) : clip_(clip) {}
  std::string name() const override { return LossName(LossId::kPpo); }
  torch::Tensor Clipped(const torch::Tensor& ratio) const override;

 private:
  torch::Tensor Loss(const Terms& terms) const override;
  ClipRange clip_;
};

class CispoLoss final : public PolicyLoss {
 public:
  explicit CispoLoss(ClipRange clip) : clip_(clip) {}
  std::string name() const override { return LossName(LossId::kCispo); }
  torch::Tensor Clipped(const torch::Tensor& ratio) const override;

 private:
  torch::Tensor Loss(const Terms& terms) const override;
  ClipRange clip_;
};

// beta weighs the quadratic penalty; loss_fn_config beta, required.
class DroLoss final : public PolicyLoss {
 public:
  explicit DroLoss(double beta) : beta_(beta) {}
  std::string name() const override { return LossName(LossId::kDro); }

 private:
  torch::Tensor Loss(const Terms& terms) const override;
  double beta_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_POLICY_LOSSES_H_
