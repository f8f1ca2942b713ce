#include "runtime/sample/sampling.h"

#include <ATen/CPUGeneratorImpl.h>

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "runtime/model/causal_lm.h"

namespace tally {
namespace {

// Steele, Lea and Flood's SplitMix64 finalizer.
uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// The logits in the dtype sampling computes in: float32, or float64 for a
// float64 model (bfloat16 and float16 logits are widened).
torch::Tensor Widened(const torch::Tensor& logits) {
  return logits.to(AtLeastFloat32(logits.scalar_type()));
}

// [B, V]: exp((logit - max) / temperature) for the tokens top-k keeps, 0
// for the others: the sampling distribution before top-p, unnormalized.
torch::Tensor ScaledWeights(const torch::Tensor& wide,
                            const SamplingParams& params) {
  const int64_t vocab = wide.size(-1);
  torch::Tensor scaled = wide - wide.amax(-1, /*keepdim=*/true);
  if (params.temperature != 1) scaled.div_(params.temperature);
  if (params.top_k > 0 && params.top_k < vocab) {
    // The k-th largest logit; every token at or above it stays.
    const torch::Tensor kth = std::get<0>(wide.topk(params.top_k, -1))
                                  .narrow(-1, params.top_k - 1, 1);
    scaled.masked_fill_(wide < kth, -std::numeric_limits<double>::infinity());
  }
  return scaled.exp_();
}

// [B, 1]: per row, the index of the last token with positive weight.
torch::Tensor LastPositive(const torch::Tensor& weights) {
  const int64_t vocab = weights.size(-1);
  return (vocab - 1) - (weights > 0)
                           .flip({-1})
                           .to(torch::kInt32)
                           .argmax(-1, /*keepdim=*/true);
}

// [B]: per row, the first token (in id order) whose cumulative weight
// exceeds u x the row's total weight, u uniform in [0, 1) from the row's
// generator. A token of weight 0 is never that first one (its cumulative
// weight equals the one before it); only rounding (u x total rounding up to
// the total) can leave none, and the row then takes its last kept token.
torch::Tensor DrawByInverseCdf(const torch::Tensor& weights,
                               std::vector<torch::Generator>& generators) {
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  std::vector<double> uniforms;
  for (torch::Generator& generator : generators) {
    uniforms.push_back(torch::rand({}, generator, f64).item<double>());
  }
  const torch::Tensor cdf = weights.cumsum(-1);
  const int64_t vocab = cdf.size(-1);
  const torch::Tensor target =
      torch::tensor(uniforms, f64).to(cdf.options()).unsqueeze(1) *
      cdf.narrow(-1, vocab - 1, 1);
  torch::Tensor first = torch::searchsorted(cdf, target, /*out_int32=*/false,
                                            /*right=*/true);
  if ((first == vocab).any().item<bool>()) {
    first = torch::minimum(first, LastPositive(weights));
  }
  return first.squeeze(1);
}

// Whether `params` sample from the model's own distribution (temperature
// 1, no top-k, no top-p).
bool ModelDistribution(const SamplingParams& params, int64_t vocab) {
  return params.temperature == 1 &&
         (params.top_k < 1 || params.top_k >= vocab) && params.top_p >= 1;
}

}  // namespace

torch::Generator SequenceGenerator(uint64_t seed, int64_t sequence) {
  return at::make_generator<at::CPUGeneratorImpl>(
      SplitMix64(SplitMix64(seed) ^ static_cast<uint64_t>(sequence)));
}

torch::Tensor SamplingDistribution(const torch::Tensor& logits,
                                   const SamplingParams& params) {
  const torch::Tensor wide = Widened(logits);
  if (params.temperature == 0) {
    return torch::one_hot(wide.argmax(-1), wide.size(-1)).to(wide.dtype());
  }
  torch::Tensor probs = ScaledWeights(wide, params);
  probs = probs / probs.sum(-1, /*keepdim=*/true);
  if (params.top_p >= 1) return probs;
  const torch::Tensor sorted = std::get<0>(probs.sort(-1, /*descending=*/true));
  // The probability of the more probable tokens before each: a token is in
  // the nucleus while that mass is still below top_p (the first always is).
  const torch::Tensor before = sorted.cumsum(-1) - sorted;
  const torch::Tensor size = (before < params.top_p).sum(-1, /*keepdim=*/true);
  const torch::Tensor least = sorted.gather(-1, size - 1);
  probs = probs.masked_fill(probs < least, 0.0);
  return probs / probs.sum(-1, /*keepdim=*/true);
}

absl::StatusOr<SampledTokens> SampleTokens(
    const torch::Tensor& logits, const SamplingParams& params,
    std::vector<torch::Generator>& generators) {
  TALLY_RETURN_IF_ERROR(ValidateSamplingParams(params));
  if (logits.dim() != 2 || logits.size(1) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("logits must be [batch, vocab], got [",
                     absl::StrJoin(logits.sizes(), ", "), "]"));
  }
  const int64_t batch = logits.size(0);
  if (static_cast<int64_t>(generators.size()) != batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("generators: ", generators.size(), " for ", batch,
                     " rows of logits; one per row"));
  }
  return CatchTorch("sampling", [&]() -> absl::StatusOr<SampledTokens> {
    torch::NoGradGuard no_grad;
    const torch::Tensor wide = Widened(logits);
    // The reported log-probability: the token's logit less the row's
    // log-sum-exp, from exp(logit - max) (no [B, V] log-softmax).
    const torch::Tensor top = wide.amax(-1, /*keepdim=*/true);
    const torch::Tensor raw = (wide - top).exp_();
    SampledTokens out;
    if (params.temperature == 0) {
      out.tokens = wide.argmax(-1);
    } else if (ModelDistribution(params, wide.size(-1))) {
      out.tokens = DrawByInverseCdf(raw, generators);
    } else {
      // Without top-p the weights need no normalizing: the draw scales its
      // uniform by their total instead.
      const torch::Tensor weights = params.top_p < 1
                                        ? SamplingDistribution(wide, params)
                                        : ScaledWeights(wide, params);
      out.tokens = DrawByInverseCdf(weights, generators);
    }
    const torch::Tensor logit =
        wide.gather(-1, out.tokens.unsqueeze(-1)).squeeze(-1);
    out.logprobs =
        (logit - top.squeeze(-1) - raw.sum(-1).log_()).to(torch::kFloat64);
    return out;
  });
}

}  // namespace tally
