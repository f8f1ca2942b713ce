// TokenLoss: the objective a ForwardBackward backpropagates, one term per
// token.
//
// A loss turns the target log-probabilities of a packed micro-batch — with
// the per-token inputs packed alongside: the weights, and named extra inputs
// a loss may need (an RL loss's advantages or the sampler's
// log-probabilities, Sample::token_inputs) — into each token's loss.
// ComputeLoss (loss.h) masks it to the valid tokens and reduces it to the
// raw, un-normalized sums the accumulation window normalizes once at
// OptimStep, so every loss obeys the window rule in the same way, on every
// mesh. A new loss is a new file with a TokenLoss subclass, registered by a
// LossId (loss_id.h) and its row in loss_spec.cc (name, settings) and in
// loss_registry.cc (its factory); policy_losses.h holds the RL ones. It reads a
// PackedBatch (loss_batch.h); loss.h, which reduces its terms, depends on it,
// not the other way round.
//
//   const tally::CrossEntropyLoss cross_entropy;
//   tally::LossTerms terms =
//       tally::ComputeLoss(cross_entropy, logprobs, batch, reduction);
//   terms.raw_loss.backward();
#ifndef TALLY_RUNTIME_TRAIN_TOKEN_LOSS_H_
#define TALLY_RUNTIME_TRAIN_TOKEN_LOSS_H_

#include <torch/torch.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "runtime/config/loss_id.h"
#include "runtime/config/loss_spec.h"
#include "runtime/config/types.h"
#include "runtime/train/loss_batch.h"

namespace tally {

class TokenLoss {
 public:
  virtual ~TokenLoss() = default;
  // For messages and metrics, e.g. "cross_entropy"; a registered loss's is
  // LossName of its LossId.
  virtual std::string name() const = 0;
  // The Sample::token_inputs it reads; every sample of a call must carry
  // each of them (ValidateLossInputs).
  virtual std::vector<std::string> required_inputs() const { return {}; }
  // [B, T] per-token losses of `batch` (rows of PackedBatch), differentiable
  // through `target_logprobs`; 0 wherever !batch.valid, even where a
  // log-probability there is not finite.
  virtual torch::Tensor TokenLosses(const torch::Tensor& target_logprobs,
                                    const PackedBatch& batch) const = 0;
  // Where the loss clips the importance ratio `ratio` (PolicyStats::
  // clipped_fraction): a bool tensor of its shape; none by default.
  virtual torch::Tensor Clipped(const torch::Tensor& ratio) const;
};

// Supervised fine-tuning's weighted cross-entropy: -w_t * log p(target_t).
// Weights of either sign: a negative one pushes the token's probability
// down (REINFORCE, and any loss sent as its gradient w.r.t. logp).
class CrossEntropyLoss final : public TokenLoss {
 public:
  std::string name() const override { return LossName(LossId::kCrossEntropy); }
  torch::Tensor TokenLosses(const torch::Tensor& target_logprobs,
                            const PackedBatch& batch) const override;
};

// The loss of a call that names none: cross-entropy.
const TokenLoss& DefaultTokenLoss();

// INVALID_ARGUMENT naming `samples[i].<name>` when a sample lacks an input
// `loss` requires.
absl::Status ValidateLossInputs(const TokenLoss& loss,
                                const std::vector<Sample>& samples);

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_TOKEN_LOSS_H_
