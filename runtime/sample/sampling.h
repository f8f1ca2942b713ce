// Sampling: how the decoder (decode.h) turns a step's logits into tokens.
// Temperature, top-k and top-p follow their published definitions, applied
// in this order to the logits of each row:
//
//   1. temperature T: p ∝ exp(logit / T); T = 0 is greedy decoding (the
//      argmax, the lowest token id among equal maxima; no draw is made).
//   2. top_k k (-1: off): only the tokens whose logit is at least the k-th
//      largest logit stay. Ties at the k-th value all stay, so more than k
//      tokens may remain.
//   3. top_p p (1: off): of the renormalized top-k distribution, the nucleus
//      is the smallest set of most probable tokens whose probability sums to
//      at least p; every token as probable as the least probable member of
//      that set stays too (ties at the boundary all stay).
//
// The token is drawn from the renormalized remainder by inverse transform
// sampling: one uniform u in [0, 1) per row, from that row's own generator,
// picks the first token (in id order) whose cumulative probability exceeds
// u. The arithmetic is in float32 (float64 for float64 logits), as
// torch.multinomial's over float32 probabilities; with top-p off the weights
// exp((logit - max) / T) are not normalized (u is scaled by their total), and
// there is no sort. A sequence's generator is seeded from (seed, sequence
// index) alone (SequenceGenerator), so its draws do not depend on what else is
// in the batch, on the batch's order or on the device; the uniforms are drawn
// on the host and the rest runs where the logits are.
//
// Each chosen token's log-probability is that of the model's distribution
// BEFORE temperature, top-k and top-p: log_softmax of the raw logits at the
// token (what Tinker reports, and what ForwardBackward computes for the same
// token): the token's logit less the row's log-sum-exp, in float32 (float64
// for float64 logits), returned as float64.
//
// SamplingParams and ValidateSamplingParams are torch-free, in
// runtime/config/sampling_params.h, so that the server checks a request's
// parameters without LibTorch.
//
//   tally::SamplingParams params;
//   params.temperature = 0.7;
//   params.top_p = 0.9;
//   TALLY_RETURN_IF_ERROR(tally::ValidateSamplingParams(params));
//   std::vector<torch::Generator> streams = {
//       tally::SequenceGenerator(seed, 0), tally::SequenceGenerator(seed, 1)};
//   TALLY_ASSIGN_OR_RETURN(tally::SampledTokens chosen,
//                          tally::SampleTokens(logits, params, streams));
#ifndef TALLY_RUNTIME_SAMPLE_SAMPLING_H_
#define TALLY_RUNTIME_SAMPLE_SAMPLING_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/config/sampling_params.h"

namespace tally {

// The random stream of sequence `sequence` of a call seeded with `seed`: a
// CPU generator whose seed mixes the two (SplitMix64), so neighbouring seeds
// and indices give unrelated streams.
torch::Generator SequenceGenerator(uint64_t seed, int64_t sequence);

// [B, V] float32 (float64 for float64 logits): the distribution a row's
// token is drawn from, after temperature, top-k and top-p (zeros for the
// tokens they remove). For greedy parameters, one-hot at the argmax.
torch::Tensor SamplingDistribution(const torch::Tensor& logits,
                                   const SamplingParams& params);

struct SampledTokens {
  torch::Tensor tokens;    // [B] int64, on the logits' device
  torch::Tensor logprobs;  // [B] float64: log_softmax(logits)[token]
};

// Chooses one token per row of `logits` [B, V] (float32 or float64) with
// `params`, drawing row b's uniform from generators[b] (which advances;
// greedy draws nothing). INVALID_ARGUMENT for invalid params, logits that
// are not [B, V] or a generator count other than B.
absl::StatusOr<SampledTokens> SampleTokens(
    const torch::Tensor& logits, const SamplingParams& params,
    std::vector<torch::Generator>& generators);

}  // namespace tally

#endif  // TALLY_RUNTIME_SAMPLE_SAMPLING_H_
