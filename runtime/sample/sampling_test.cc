// The sampler's math (runtime/sample/sampling.h) against the definitions of
// temperature, top-k and top-p on fixed logits, a seeded distribution test
// whose tolerance follows from the sample count, greedy = argmax, per-sequence
// streams that ignore the rest of the batch, and the reported
// log-probability.
#include "runtime/sample/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <vector>

namespace tally {
namespace {

const auto kF64 = torch::TensorOptions().dtype(torch::kFloat64);

// One row of logits whose softmax is `probs`.
torch::Tensor LogitsOf(const std::vector<double>& probs) {
  return torch::tensor(probs, kF64).log().unsqueeze(0);
}

// Row 0 of SamplingDistribution as a vector.
std::vector<double> Distribution(const torch::Tensor& logits,
                                 const SamplingParams& params) {
  torch::Tensor row = SamplingDistribution(logits, params)[0].contiguous();
  return std::vector<double>(row.data_ptr<double>(),
                             row.data_ptr<double>() + row.numel());
}

// p normalized to sum 1, entries outside `kept` zero.
std::vector<double> Renormalized(std::vector<double> p,
                                 const std::vector<bool>& kept) {
  double total = 0;
  for (size_t i = 0; i < p.size(); ++i) total += kept[i] ? p[i] : 0.0;
  for (size_t i = 0; i < p.size(); ++i) p[i] = kept[i] ? p[i] / total : 0.0;
  return p;
}

void ExpectNear(const std::vector<double>& actual,
                const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 1e-12) << "token " << i;
  }
}

std::vector<torch::Generator> Streams(uint64_t seed,
                                      const std::vector<int64_t>& sequences) {
  std::vector<torch::Generator> streams;
  for (int64_t s : sequences) streams.push_back(SequenceGenerator(seed, s));
  return streams;
}

std::vector<int64_t> ToVector(const torch::Tensor& t) {
  torch::Tensor c = t.to(torch::kInt64).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(),
                              c.data_ptr<int64_t>() + c.numel());
}

TEST(SamplingParamsTest, RefusesEachFieldOutOfRangeByName) {
  EXPECT_TRUE(ValidateSamplingParams({}).ok());
  EXPECT_TRUE(ValidateSamplingParams({0.0, 1.0, -1}).ok());
  EXPECT_TRUE(ValidateSamplingParams({2.0, 0.01, 1}).ok());
  const struct {
    SamplingParams params;
    const char* field;
  } bad[] = {
      {{-0.5, 1.0, -1}, "temperature"},
      {{NAN, 1.0, -1}, "temperature"},
      {{INFINITY, 1.0, -1}, "temperature"},
      {{1.0, 0.0, -1}, "top_p"},
      {{1.0, 1.5, -1}, "top_p"},
      {{1.0, NAN, -1}, "top_p"},
      {{1.0, 1.0, 0}, "top_k"},
      {{1.0, 1.0, -2}, "top_k"},
  };
  for (const auto& [params, field] : bad) {
    const absl::Status status = ValidateSamplingParams(params);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(status.message().find(field), absl::string_view::npos)
        << status.message();
  }
  std::vector<torch::Generator> one = Streams(1, {0});
  EXPECT_EQ(
      SampleTokens(LogitsOf({0.5, 0.5}), {1.0, 1.0, 0}, one).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(SamplingParamsTest, RefusesMisshapedLogitsAndGeneratorCounts) {
  std::vector<torch::Generator> two = Streams(1, {0, 1});
  EXPECT_EQ(SampleTokens(torch::zeros({3, 4}, kF64), {}, two).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      SampleTokens(torch::zeros({2, 3, 4}, kF64), {}, two).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// The distributions, each computed from its definition by hand.
const std::vector<double> kProbs = {0.06, 0.4, 0.04, 0.15, 0.25, 0.1};

TEST(SamplingDistributionTest, TemperatureScalesLogits) {
  std::vector<double> expected;
  for (double p : kProbs) expected.push_back(std::pow(p, 1.0 / 2.0));
  ExpectNear(Distribution(LogitsOf(kProbs), {2.0, 1.0, -1}),
             Renormalized(expected, std::vector<bool>(6, true)));
  ExpectNear(Distribution(LogitsOf(kProbs), {1.0, 1.0, -1}), kProbs);
}

TEST(SamplingDistributionTest, TopKKeepsTheKMostLikely) {
  ExpectNear(Distribution(LogitsOf(kProbs), {1.0, 1.0, 3}),
             Renormalized(kProbs, {false, true, false, true, true, false}));
  ExpectNear(Distribution(LogitsOf(kProbs), {1.0, 1.0, 1}), {0, 1, 0, 0, 0, 0});
  // k at least the vocabulary: off.
  ExpectNear(Distribution(LogitsOf(kProbs), {1.0, 1.0, 6}), kProbs);
  ExpectNear(Distribution(LogitsOf(kProbs), {1.0, 1.0, 50}), kProbs);
  // Ties at the k-th logit all stay.
  const std::vector<double> tied = {0.3, 0.2, 0.2, 0.2, 0.1};
  ExpectNear(Distribution(LogitsOf(tied), {1.0, 1.0, 2}),
             Renormalized(tied, {true, true, true, true, false}));
}

TEST(SamplingDistributionTest, TopPKeepsTheSmallestNucleus) {
  // Sorted: 0.4, 0.25, 0.15, 0.1, 0.06, 0.04; cumulative 0.4, 0.65, 0.8 ...
  ExpectNear(Distribution(LogitsOf(kProbs), {1.0, 0.6, -1}),
             Renormalized(kProbs, {false, true, false, false, true, false}));
  ExpectNear(Distribution(LogitsOf(kProbs), {1.0, 0.7, -1}),
             Renormalized(kProbs, {false, true, false, true, true, false}));
  // A nucleus always holds the most likely token.
  ExpectNear(Distribution(LogitsOf(kProbs), {1.0, 0.01, -1}),
             {0, 1, 0, 0, 0, 0});
  // Ties at the boundary all stay: 0.3 + 0.2 reaches 0.45 with one of the
  // three tokens of 0.2.
  const std::vector<double> tied = {0.2, 0.3, 0.2, 0.2, 0.1};
  ExpectNear(Distribution(LogitsOf(tied), {1.0, 0.45, -1}),
             Renormalized(tied, {true, true, true, true, false}));
}

TEST(SamplingDistributionTest, TopKThenTopPOnTheTemperatureScaledLogits) {
  // Temperature 0.5 squares the probabilities; top-k 4 keeps 0.4, 0.25,
  // 0.15, 0.1; top-p 0.8 of their renormalized squares (0.16, 0.0625,
  // 0.0225, 0.01 over 0.255: 0.627, 0.245, 0.088, 0.039) keeps the first
  // two (0.627 < 0.8 <= 0.873).
  std::vector<double> squared;
  for (double p : kProbs) squared.push_back(p * p);
  ExpectNear(Distribution(LogitsOf(kProbs), {0.5, 0.8, 4}),
             Renormalized(squared, {false, true, false, false, true, false}));
}

TEST(SamplingDistributionTest, GreedyIsOneHotAtTheFirstMaximum) {
  ExpectNear(Distribution(LogitsOf({0.1, 0.45, 0.45}), {0.0, 1.0, -1}),
             {0, 1, 0});
}

TEST(SampleTokensTest, GreedyIsArgmaxWithRawLogprobs) {
  torch::manual_seed(3);
  const torch::Tensor logits = torch::randn({5, 11}, kF64) * 3;
  std::vector<torch::Generator> streams = Streams(9, {0, 1, 2, 3, 4});
  // Greedy ignores top-k and top-p.
  SampledTokens chosen = SampleTokens(logits, {0.0, 0.3, 2}, streams).value();
  for (int64_t b = 0; b < 5; ++b) {
    const torch::Tensor row = logits[b];
    const int64_t token = chosen.tokens[b].item<int64_t>();
    EXPECT_EQ(token, row.argmax().item<int64_t>());
    EXPECT_DOUBLE_EQ(row.max().item<double>(), row[token].item<double>());
  }
}

TEST(SampleTokensTest, LogprobIsLogSoftmaxOfTheRawLogits) {
  torch::manual_seed(4);
  for (torch::ScalarType type : {torch::kFloat64, torch::kFloat32}) {
    const torch::Tensor logits = (torch::randn({6, 13}, kF64) * 2).to(type);
    std::vector<torch::Generator> streams = Streams(5, {0, 1, 2, 3, 4, 5});
    for (const SamplingParams& params :
         {SamplingParams{0.0, 1.0, -1}, SamplingParams{0.5, 0.7, 3},
          SamplingParams{1.7, 1.0, -1}}) {
      SampledTokens chosen = SampleTokens(logits, params, streams).value();
      ASSERT_EQ(chosen.logprobs.scalar_type(), torch::kFloat64);
      for (int64_t b = 0; b < 6; ++b) {
        // log p = logit - log sum exp(logits), summed by hand in float64.
        const torch::Tensor row = logits[b].to(torch::kFloat64).contiguous();
        const double* l = row.data_ptr<double>();
        const double top = *std::max_element(l, l + 13);
        double sum = 0;
        for (int i = 0; i < 13; ++i) sum += std::exp(l[i] - top);
        const int64_t token = chosen.tokens[b].item<int64_t>();
        const double expected = l[token] - top - std::log(sum);
        EXPECT_NEAR(chosen.logprobs[b].item<double>(), expected,
                    type == torch::kFloat64 ? 1e-13 : 1e-5)
            << "temperature " << params.temperature;
      }
    }
  }
}

// Float32 logits are sampled in float32: the same distribution as float64's
// to float32 rounding, without a float64 copy.
TEST(SamplingDistributionTest, Float32LogitsStayFloat32) {
  for (const SamplingParams& params :
       {SamplingParams{1.0, 1.0, -1}, SamplingParams{0.5, 0.8, 4},
        SamplingParams{1.7, 0.9, -1}}) {
    const torch::Tensor wide = SamplingDistribution(LogitsOf(kProbs), params);
    const torch::Tensor narrow =
        SamplingDistribution(LogitsOf(kProbs).to(torch::kFloat32), params);
    EXPECT_EQ(narrow.scalar_type(), torch::kFloat32);
    EXPECT_LE((narrow.to(torch::kFloat64) - wide).abs().max().item<double>(),
              1e-6);
  }
}

// Draws N tokens from one row of logits (float64, then float32), each from
// its own stream (one call, N rows), and checks every token's count against
// the distribution's definition: within 5 standard deviations of the
// binomial, and exactly 0 for the removed tokens. Reruns reproduce the
// counts (fixed seed).
TEST(SampleTokensTest, DrawsFollowTheDistribution) {
  constexpr int64_t kDraws = 10000;
  const std::vector<double> probs = {0.06, 0.4, 0.04, 0.15, 0.25, 0.1};
  std::vector<int64_t> sequences(kDraws);
  std::iota(sequences.begin(), sequences.end(), 0);
  for (const torch::ScalarType type : {torch::kFloat64, torch::kFloat32}) {
    for (const SamplingParams& params :
         {SamplingParams{1.0, 1.0, -1}, SamplingParams{0.8, 0.9, 4},
          SamplingParams{1.3, 1.0, 3}, SamplingParams{2.0, 0.75, -1}}) {
      const torch::Tensor row = LogitsOf(probs);
      const std::vector<double> expected = Distribution(row, params);
      std::vector<torch::Generator> streams = Streams(2024, sequences);
      SampledTokens chosen =
          SampleTokens(row.to(type).expand({kDraws, 6}), params, streams)
              .value();
      const std::vector<int64_t> counts =
          ToVector(torch::bincount(chosen.tokens, {}, 6));
      for (size_t i = 0; i < probs.size(); ++i) {
        const double mean = kDraws * expected[i];
        const double sigma =
            std::sqrt(kDraws * expected[i] * (1 - expected[i]));
        if (expected[i] == 0) {
          EXPECT_EQ(counts[i], 0) << "removed token " << i;
        } else {
          EXPECT_NEAR(static_cast<double>(counts[i]), mean, 5 * sigma)
              << "token " << i << " temperature " << params.temperature << " "
              << type;
        }
      }
    }
  }
}

// One generator drawn repeatedly: consecutive draws follow the distribution
// too (a stream, not only its first value).
TEST(SampleTokensTest, ConsecutiveDrawsOfOneStreamFollowTheDistribution) {
  constexpr int kDraws = 4000;
  const std::vector<double> probs = {0.5, 0.3, 0.2};
  std::vector<torch::Generator> stream = Streams(77, {3});
  std::vector<int64_t> counts(3, 0);
  for (int i = 0; i < kDraws; ++i) {
    ++counts[SampleTokens(LogitsOf(probs), {}, stream)
                 .value()
                 .tokens[0]
                 .item<int64_t>()];
  }
  for (size_t i = 0; i < probs.size(); ++i) {
    const double sigma = std::sqrt(kDraws * probs[i] * (1 - probs[i]));
    EXPECT_NEAR(static_cast<double>(counts[i]), kDraws * probs[i], 5 * sigma);
  }
}

// Sequence 1's tokens are the same alone, first or last in the batch, beside
// any other rows; another index gives another stream.
TEST(SampleTokensTest, ASequencesDrawsIgnoreTheRestOfTheBatch) {
  constexpr int kSteps = 24;
  torch::manual_seed(11);
  const torch::Tensor mine = torch::randn({kSteps, 1, 16}, kF64);
  const torch::Tensor others = torch::randn({kSteps, 3, 16}, kF64);
  const SamplingParams params{1.2, 0.95, 12};
  auto run = [&](const std::vector<int64_t>& sequences, int64_t at,
                 int64_t others_count) {
    std::vector<torch::Generator> streams = Streams(42, sequences);
    std::vector<int64_t> tokens;
    for (int step = 0; step < kSteps; ++step) {
      const torch::Tensor rest = others[step].narrow(0, 0, others_count);
      const torch::Tensor logits =
          torch::cat({rest.narrow(0, 0, at), mine[step],
                      rest.narrow(0, at, others_count - at)});
      tokens.push_back(SampleTokens(logits, params, streams)
                           .value()
                           .tokens[at]
                           .item<int64_t>());
    }
    return tokens;
  };
  const std::vector<int64_t> alone = run({1}, 0, 0);
  EXPECT_EQ(run({1, 0, 2, 3}, 0, 3), alone);
  EXPECT_EQ(run({5, 9, 1}, 2, 2), alone);
  EXPECT_EQ(run({0, 1}, 1, 1), alone);
  // The draws do vary, and another sequence index draws differently.
  EXPECT_GT(std::set<int64_t>(alone.begin(), alone.end()).size(), 3u);
  EXPECT_NE(run({2}, 0, 0), alone);
}

}  // namespace
}  // namespace tally
