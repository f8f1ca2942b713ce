#include "runtime/train/policy_losses.h"

#include "runtime/train/loss_batch.h"

namespace tally {

torch::Tensor PolicyLoss::TokenLosses(const torch::Tensor& target_logprobs,
                                      const PackedBatch& batch) const {
  const torch::Tensor& valid = batch.valid;
  const auto input = [&](const char* name) {
    // Every sample carries the inputs (ValidateLossInputs); a rank's padding
    // micro-batch, which has no valid token, has none.
    const auto it = batch.token_inputs.find(name);
    if (it == batch.token_inputs.end())
      return torch::zeros_like(target_logprobs);
    return it->second.to(target_logprobs.scalar_type())
        .masked_fill(~valid, 0.0);
  };
  Terms terms;
  // Masked before exp: a non-finite logp off the valid tokens would turn
  // the zero gradient there into NaN.
  terms.logprobs = target_logprobs.masked_fill(~valid, 0.0);
  terms.advantages = input(kAdvantages);
  terms.log_ratio = terms.logprobs - input(kSamplingLogprobs);
  // Capped at e^kMaxLogRatio: past float32's e^88 the ratio would be
  // infinite and its gradient NaN; the cap is flat, so such a token pushes
  // no gradient through the ratio.
  terms.ratio = terms.log_ratio.clamp_max(kMaxLogRatio).exp();
  return Loss(terms).masked_fill(~valid, 0.0) * batch.weights;
}

torch::Tensor ImportanceSamplingLoss::Loss(const Terms& terms) const {
  return -terms.ratio * terms.advantages;
}

namespace {

torch::Tensor OutsideRange(const torch::Tensor& ratio, const ClipRange& clip) {
  return (ratio < clip.low).logical_or(ratio > clip.high);
}

}  // namespace

torch::Tensor PpoLoss::Loss(const Terms& terms) const {
  const torch::Tensor unclipped = terms.ratio * terms.advantages;
  const torch::Tensor clipped =
      terms.ratio.clamp(clip_.low, clip_.high) * terms.advantages;
  return -torch::minimum(unclipped, clipped);
}

torch::Tensor PpoLoss::Clipped(const torch::Tensor& ratio) const {
  return OutsideRange(ratio, clip_);
}

torch::Tensor CispoLoss::Loss(const Terms& terms) const {
  const torch::Tensor coefficient =
      terms.ratio.detach().clamp(clip_.low, clip_.high);
  return -coefficient * terms.logprobs * terms.advantages;
}

torch::Tensor CispoLoss::Clipped(const torch::Tensor& ratio) const {
  return OutsideRange(ratio, clip_);
}

torch::Tensor DroLoss::Loss(const Terms& terms) const {
  return -(terms.logprobs * terms.advantages -
           0.5 * beta_ * terms.log_ratio.square());
}

}  // namespace tally
