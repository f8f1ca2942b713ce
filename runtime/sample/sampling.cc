#include "runtime/sample/sampling.h"

#include <ATen/CPUGeneratorImpl.h>

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace tally {
namespace {

// Steele, Lea and Flood's SplitMix64 finalizer.
uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// [B, 1]: per row, the index of the last token with positive probability.
torch::Tensor LastPositive(const torch::Tensor& probs) {
  const int64_t vocab = probs.size(-1);
  return (vocab - 1) -
         (probs > 0).flip({-1}).to(torch::kInt32).argmax(-1, /*keepdim=*/true);
}

}  // namespace

torch::Generator SequenceGenerator(uint64_t seed, int64_t sequence) {
  return at::make_generator<at::CPUGeneratorImpl>(
      SplitMix64(SplitMix64(seed) ^ static_cast<uint64_t>(sequence)));
}

torch::Tensor SamplingDistribution(const torch::Tensor& logits,
                                   const SamplingParams& params) {
  const torch::Tensor wide = logits.to(torch::kFloat64);
  const int64_t vocab = wide.size(-1);
  if (params.temperature == 0) {
    return torch::one_hot(wide.argmax(-1), vocab).to(torch::kFloat64);
  }
  torch::Tensor scaled = wide / params.temperature;
  if (params.top_k > 0 && params.top_k < vocab) {
    // The k-th largest logit; every token at or above it stays.
    const torch::Tensor kth = std::get<0>(wide.topk(params.top_k, -1))
                                  .narrow(-1, params.top_k - 1, 1);
    scaled = scaled.masked_fill(wide < kth,
                                -std::numeric_limits<double>::infinity());
  }
  torch::Tensor probs = torch::softmax(scaled, -1);
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
    SampledTokens out;
    if (params.temperature == 0) {
      out.tokens = logits.argmax(-1);
    } else {
      const torch::Tensor probs = SamplingDistribution(logits, params);
      const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
      std::vector<double> uniforms;
      for (torch::Generator& generator : generators) {
        uniforms.push_back(torch::rand({}, generator, f64).item<double>());
      }
      const torch::Tensor cdf = probs.cumsum(-1);
      const torch::Tensor target =
          torch::tensor(uniforms, f64).to(logits.device()).unsqueeze(1) *
          cdf.narrow(-1, cdf.size(-1) - 1, 1);
      // The first token whose cumulative probability exceeds the target;
      // rounding can leave none, or a removed token at the end: the last
      // kept one then.
      const torch::Tensor first =
          torch::searchsorted(cdf, target, /*out_int32=*/false,
                              /*right=*/true);
      out.tokens = torch::minimum(first, LastPositive(probs)).squeeze(1);
    }
    out.logprobs = torch::log_softmax(logits, -1)
                       .gather(-1, out.tokens.unsqueeze(-1))
                       .squeeze(-1)
                       .to(torch::kFloat64);
    return out;
  });
}

}  // namespace tally
