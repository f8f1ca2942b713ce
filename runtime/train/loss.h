// Loss: turns a call's samples into a padded batch and the model's per-token
// log-probabilities into the raw (un-normalized) loss that tally
// backpropagates, with the counts that make up the window's normalizer.
//
// The raw loss never divides by anything global: TOKEN_MEAN and SUM
// backpropagate sum(w * l) over valid tokens; SAMPLE_MEAN backpropagates
// sum_b (1 / T_b) sum_{i in b} w * l. OptimStep divides the accumulated
// gradient by the window's token or sample count, which makes the step equal
// to one single-device step on every sample of the window.
//
//   TALLY_RETURN_IF_ERROR(tally::ValidateSamples(config, samples));
//   for (const std::vector<int>& rows : tally::PlanBatches(samples, all, 8192))
//   {
//     tally::PackedBatch batch = tally::PackRows(samples, rows, dtype);
//     torch::Tensor logprobs = model.TargetLogprobs(batch.inputs, ...);
//     tally::LossTerms terms = tally::ComputeLoss(logprobs, batch, reduction);
//     terms.raw_loss.backward();
//   }
#ifndef TALLY_RUNTIME_TRAIN_LOSS_H_
#define TALLY_RUNTIME_TRAIN_LOSS_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/types.h"
#include "runtime/train/loss_batch.h"
#include "runtime/train/token_loss.h"

namespace tally {

// INVALID_ARGUMENT naming `samples[i].<field>` for an empty list, length
// mismatches, empty samples, samples longer than max_position_embeddings,
// tokens outside [0, vocab) (targets may also be -100), non-finite weights
// or token inputs, and sampling_logprobs outside [kMinSamplingLogprob, 0]
// where the token counts (target not -100, weight not 0).
// Weights may be negative.
absl::Status ValidateSamples(const LlamaConfig& config,
                             const std::vector<Sample>& samples);

// Groups the samples `indices` of `samples` into batches of
// at most `max_batch_tokens` padded tokens (a longer sample gets a batch of
// its own), longest first so each batch holds similar lengths. Returns the
// sample indices of each batch; a pure function of its inputs, so every rank
// can plan every other rank's batches.
std::vector<std::vector<int>> PlanBatches(const std::vector<Sample>& samples,
                                          const std::vector<int>& indices,
                                          int64_t max_batch_tokens);

// Assigns each sample to one of `num_ranks` data-parallel ranks, balancing
// valid tokens (largest first, to the least loaded rank, ties to the lower
// rank). Deterministic; a rank may get nothing.
std::vector<std::vector<int>> PartitionSamples(
    const std::vector<Sample>& samples, int num_ranks);

struct LossTerms {
  torch::Tensor raw_loss;  // scalar, differentiable
  // On the host, whatever the model's device.
  torch::Tensor sample_loss_sums;     // [B] fp64, detached: sum of w * l
  torch::Tensor sample_valid_tokens;  // [B] int64, of this batch's rows
  int64_t valid_tokens = 0;
};

// `sample_tokens` [B] int64: the valid-token count T_b of each row's whole
// sample, which SAMPLE_MEAN divides by. Leave it undefined when the rows hold
// whole samples (their own counts are T_b); under context parallelism a row
// holds a part of its sample and T_b comes from the whole cp group.
// `loss` gives each token's term; the default is cross-entropy.
LossTerms ComputeLoss(const TokenLoss& loss,
                      const torch::Tensor& target_logprobs,
                      const PackedBatch& batch, LossReduction reduction,
                      const torch::Tensor& sample_tokens = {});
LossTerms ComputeLoss(const torch::Tensor& target_logprobs,
                      const PackedBatch& batch, LossReduction reduction,
                      const torch::Tensor& sample_tokens = {});

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_LOSS_H_
