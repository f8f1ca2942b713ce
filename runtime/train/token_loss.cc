#include "runtime/train/token_loss.h"

#include "absl/strings/str_cat.h"

namespace tally {

torch::Tensor CrossEntropyLoss::TokenLosses(
    const torch::Tensor& target_logprobs, const PackedBatch& batch) const {
  // Padding and ignored positions carry weight 0; masked_fill also stops a
  // non-finite logprob there from leaking NaN into the sum (0 * inf = NaN).
  return (-target_logprobs).masked_fill(~batch.valid, 0.0) * batch.weights;
}

torch::Tensor TokenLoss::Clipped(const torch::Tensor& ratio) const {
  return torch::zeros_like(ratio, torch::kBool);
}

const TokenLoss& DefaultTokenLoss() {
  static const CrossEntropyLoss* const kCrossEntropy = new CrossEntropyLoss;
  return *kCrossEntropy;
}

absl::Status ValidateLossInputs(const TokenLoss& loss,
                                const std::vector<Sample>& samples) {
  for (const std::string& name : loss.required_inputs()) {
    for (size_t i = 0; i < samples.size(); ++i) {
      if (samples[i].token_inputs.count(name) == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("samples[", i, "].", name, " is required by the ",
                         loss.name(), " loss"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace tally
