// The RL losses: each token's loss and its derivative w.r.t. the trainer's
// log-probability equal Tinker's formulas computed here by hand (scalar
// code, no shared tensor path); PPO is importance sampling while no ratio
// is clipped; the settings are parsed and refused as documented; policy
// statistics are exact and combine exactly; and on a single-rank engine a
// window gives the same gradient however it is split into calls, with losses
// mixed across its calls.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "absl/strings/str_cat.h"
#include "runtime/config/loss_id.h"
#include "runtime/engine/engine.h"
#include "runtime/train/loss.h"
#include "runtime/train/loss_registry.h"
#include "runtime/train/loss_report.h"
#include "runtime/train/policy_losses.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

// One sample of 8 tokens: the trainer's logp, the sampler's q, advantages
// and weights (one negative, one zero); ratios exp(logp - q) from 0.61 to
// 1.65, 3 of the 7 valid ones outside [0.8, 1.2] (the zero-weight one, 1.82,
// would be a fourth).
struct Tokens {
  std::vector<double> logp = {-1.0, -2.0, -0.5, -3.0, -1.5, -2.5, -0.7, -1.2};
  std::vector<float> q = {-1.5f,  -1.5f, -0.5f, -3.6f,
                          -1.45f, -2.4f, -0.2f, -1.0f};
  std::vector<float> advantages = {1.0f,  -0.5f, 2.0f,  0.3f,
                                   -1.0f, 1.5f,  -2.0f, 0.7f};
  std::vector<float> weights = {1.0f,  2.0f, 1.0f, 0.0f,
                                -1.0f, 0.5f, 1.0f, 1.0f};
};

Sample ToSample(const Tokens& k) {
  Sample s;
  s.input_tokens.assign(k.logp.size(), 1);
  s.target_tokens.assign(k.logp.size(), 2);
  s.weights = k.weights;
  s.token_inputs[kAdvantages] = k.advantages;
  s.token_inputs[kSamplingLogprobs] = k.q;
  return s;
}

// Per token: Tinker's loss of one token before weighting, and its
// derivative w.r.t. logp, from the formula.
struct Reference {
  std::function<double(double logp, double q, double a)> loss;
  std::function<double(double logp, double q, double a)> derivative;
};

double Clip(double r, double low, double high) {
  return std::min(std::max(r, low), high);
}

Reference ReferenceOf(const std::string& name, double low, double high,
                      double beta) {
  if (name == "importance_sampling") {
    return {
        [](double lp, double q, double a) { return -std::exp(lp - q) * a; },
        [](double lp, double q, double a) { return -std::exp(lp - q) * a; }};
  }
  if (name == "ppo") {
    return {[=](double lp, double q, double a) {
              const double r = std::exp(lp - q);
              return -std::min(r * a, Clip(r, low, high) * a);
            },
            [=](double lp, double q, double a) {
              const double r = std::exp(lp - q);
              // The clipped term is chosen (flat in logp) when it is the
              // smaller one and the ratio lies outside the range.
              const bool clipped_chosen =
                  Clip(r, low, high) * a < r * a && (r < low || r > high);
              return clipped_chosen ? 0.0 : -r * a;
            }};
  }
  if (name == "cispo") {
    return {[=](double lp, double q, double a) {
              return -Clip(std::exp(lp - q), low, high) * lp * a;
            },
            [=](double lp, double q, double a) {
              return -Clip(std::exp(lp - q), low, high) * a;
            }};
  }
  if (name == "dro") {
    return {
        [=](double lp, double q, double a) {
          return -(lp * a - 0.5 * beta * (lp - q) * (lp - q));
        },
        [=](double lp, double q, double a) { return -(a - beta * (lp - q)); }};
  }
  return {[](double lp, double, double) { return -lp; },
          [](double, double, double) { return -1.0; }};
}

class PolicyLossFormulaTest : public ::testing::TestWithParam<const char*> {};

TEST_P(PolicyLossFormulaTest, TokenLossesAndGradientsAreTinkersFormulas) {
  const std::string name = GetParam();
  const double low = 0.85, high = 1.3, beta = 0.4;
  std::map<std::string, double> config;
  if (name == "ppo" || name == "cispo") {
    config = {{"clip_low_threshold", low}, {"clip_high_threshold", high}};
  }
  if (name == "dro") config = {{"beta", beta}};
  const LossSpec spec = ParseLossSpec(name, config).value();
  const std::shared_ptr<const TokenLoss> loss = MakeTokenLoss(spec).value();
  const Reference ref = ReferenceOf(name, low, high, beta);

  const Tokens k;
  const std::vector<Sample> samples = {ToSample(k)};
  const PackedBatch batch = PackRows(samples, {0}, torch::kFloat64);
  torch::Tensor logp =
      torch::tensor(k.logp, torch::kFloat64).unsqueeze(0).requires_grad_();
  const torch::Tensor losses = loss->TokenLosses(logp, batch);
  losses.sum().backward();
  for (size_t t = 0; t < k.logp.size(); ++t) {
    SCOPED_TRACE(t);
    const double w = k.weights[t];
    const double want = w * ref.loss(k.logp[t], k.q[t], k.advantages[t]);
    const double grad = w * ref.derivative(k.logp[t], k.q[t], k.advantages[t]);
    EXPECT_NEAR(losses[0][t].item<double>(), want, 1e-12);
    EXPECT_NEAR(logp.grad()[0][t].item<double>(), grad, 1e-12);
  }
}

INSTANTIATE_TEST_SUITE_P(Losses, PolicyLossFormulaTest,
                         ::testing::Values("cross_entropy",
                                           "importance_sampling", "ppo",
                                           "cispo", "dro"));

TEST(PolicyLossTest, PpoIsImportanceSamplingWhileNoRatioIsClipped) {
  Tokens k;
  for (size_t t = 0; t < k.q.size(); ++t) {
    k.q[t] = static_cast<float>(k.logp[t] + 0.1 * (t % 3) - 0.1);  // ratio
  }
  const std::vector<Sample> samples = {ToSample(k)};
  const PackedBatch batch = PackRows(samples, {0}, torch::kFloat64);
  auto run = [&](const char* name) {
    const auto loss = MakeTokenLoss(ParseLossSpec(name, {}).value()).value();
    torch::Tensor logp =
        torch::tensor(k.logp, torch::kFloat64).unsqueeze(0).requires_grad_();
    const torch::Tensor losses = loss->TokenLosses(logp, batch);
    losses.sum().backward();
    return std::pair{losses.detach(), logp.grad()};
  };
  const auto [ppo_loss, ppo_grad] = run("ppo");
  const auto [is_loss, is_grad] = run("importance_sampling");
  EXPECT_TRUE(torch::allclose(ppo_loss, is_loss, 0, 1e-15));
  EXPECT_TRUE(torch::allclose(ppo_grad, is_grad, 0, 1e-15));
  EXPECT_GT(is_grad.abs().sum().item<double>(), 0);
}

// A sampler log-probability far below the trainer's (a sentinel) caps the
// ratio at e^kMaxLogRatio instead of overflowing float32: the losses stay
// finite and the token's gradient through the ratio is 0, not NaN.
TEST(PolicyLossTest, AnExtremeRatioIsCappedNotInfinite) {
  Tokens k;
  k.q[1] = -9999.0f;
  const std::vector<Sample> samples = {ToSample(k)};
  const PackedBatch batch = PackRows(samples, {0}, torch::kFloat32);
  for (const char* name : {"importance_sampling", "ppo", "cispo"}) {
    SCOPED_TRACE(name);
    const auto loss = MakeTokenLoss(ParseLossSpec(name, {}).value()).value();
    torch::Tensor logp =
        torch::tensor(k.logp, torch::kFloat32).unsqueeze(0).requires_grad_();
    const torch::Tensor losses = loss->TokenLosses(logp, batch);
    losses.sum().backward();
    EXPECT_TRUE(torch::isfinite(losses).all().item<bool>()) << losses;
    EXPECT_TRUE(torch::isfinite(logp.grad()).all().item<bool>()) << logp.grad();
  }
}

// A sampling log-probability must be one: finite, <= 0 and no lower than
// kMinSamplingLogprob. Anything else is refused naming the sample, field and
// position, before anything runs; before, one DRO call with -1e30 was
// accepted and gave a gradient of norm ~1e30.
TEST(PolicyLossTest, SamplingLogprobsOutsideTheirRangeAreRefused) {
  auto engine = Engine::CreateSingleRank({}).value();
  ASSERT_TRUE(engine
                  ->CreateModel(testing::TinySpec("m", DType::kFloat32,
                                                  OptimizerKind::kAdamW))
                  .ok());
  auto call = [&](float at3, float at4) {
    std::vector<Sample> samples = testing::MakeSamples(48, {12}, 1);
    const size_t tokens = samples[0].input_tokens.size();
    samples[0].target_tokens.assign(tokens, 2);  // every token counts
    samples[0].token_inputs[kAdvantages].assign(tokens, 1.0f);
    std::vector<float>& q = samples[0].token_inputs[kSamplingLogprobs];
    q.assign(tokens, -1.0f);
    q[3] = at3;
    q[4] = at4;
    ForwardBackwardArgs args{samples};
    args.loss = ParseLossSpec("dro", {{"beta", 1.0}}).value();
    return engine->ForwardBackward("m", args).status();
  };
  for (float bad : {-1e30f, -1.5e4f, 0.5f}) {
    SCOPED_TRACE(bad);
    const absl::Status refused = call(bad, -1.0f);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(refused.message()),
                HasSubstr("samples[0].sampling_logprobs[3] = "));
    EXPECT_THAT(std::string(refused.message()),
                HasSubstr("must be a log-probability in [-10000, 0]"));
    EXPECT_EQ(engine->GetModel("m")->window.calls, 0);
  }
  // The bounds themselves are log-probabilities.
  EXPECT_TRUE(call(static_cast<float>(kMinSamplingLogprob), 0.0f).ok());
  EXPECT_EQ(engine->GetModel("m")->window.calls, 1);
}

// A router auxiliary loss enters each token's log-probability, which the
// policy losses' ratio and negative weights would distort: refused, naming
// the field, before anything runs.
TEST(PolicyLossTest, ARouterAuxiliaryLossTakesCrossEntropyWithWeightsOnly) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec =
      testing::TinySpec("moe", DType::kFloat64, OptimizerKind::kAdamW);
  spec.config.num_local_experts = 4;
  spec.config.num_experts_per_tok = 2;
  spec.config.router_aux_loss_coef = 0.02;
  spec.config.output_router_logits = true;
  ASSERT_TRUE(engine->CreateModel(spec).ok());
  std::vector<Sample> samples =
      testing::MakeSamples(spec.config.vocab_size, {3, 4}, 5);
  testing::AddPolicyInputs(samples, -3.0, 6);  // also negative weights
  ForwardBackwardArgs ppo{samples};
  ppo.loss = ParseLossSpec("ppo", {}).value();
  const absl::Status refused = engine->ForwardBackward("moe", ppo).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("loss_fn ppo"));
  const absl::Status negative =
      engine->ForwardBackward("moe", {samples}).status();
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.message(), HasSubstr("].weights["));
  EXPECT_EQ(engine->GetModel("moe")->window.calls, 0);
  for (Sample& sample : samples) {
    for (float& w : sample.weights) w = std::abs(w);
  }
  EXPECT_TRUE(engine->ForwardBackward("moe", {samples}).ok());
}

TEST(PolicyLossTest, PolicyStatisticsAreExact) {
  const Tokens k;
  ForwardBackwardArgs args;
  args.samples = {ToSample(k)};
  args.loss = ParseLossSpec("ppo", {}).value();
  ForwardBackwardResult result;
  result.samples.resize(1);
  result.samples[0].logprobs = k.logp;
  ReportLoss(*MakeTokenLoss(args.loss).value(), args, result);
  ASSERT_TRUE(result.samples[0].policy.has_value());
  ASSERT_TRUE(result.policy.has_value());
  const PolicyStats& stats = *result.policy;
  // Token 3 has weight 0: 7 valid tokens. By hand:
  double ratio_sum = 0, gap_sum = 0, gap_max = 0, k3 = 0, ratio_min = 1e9;
  double ratio_max = 0;
  int clipped = 0;
  for (size_t t = 0; t < k.logp.size(); ++t) {
    if (t == 3) continue;
    const double d = k.logp[t] - k.q[t], r = std::exp(d);
    ratio_sum += r;
    ratio_min = std::min(ratio_min, r);
    ratio_max = std::max(ratio_max, r);
    gap_sum += std::abs(d);
    gap_max = std::max(gap_max, std::abs(d));
    k3 += r - 1 - d;
    clipped += r < 0.8 || r > 1.2;
  }
  EXPECT_EQ(clipped, 3);
  EXPECT_EQ(stats.tokens, 7);
  EXPECT_DOUBLE_EQ(stats.clipped_fraction, 3.0 / 7);
  EXPECT_NEAR(stats.ratio_mean, ratio_sum / 7, 1e-14);
  EXPECT_NEAR(stats.ratio_min, ratio_min, 1e-14);
  EXPECT_NEAR(stats.ratio_max, ratio_max, 1e-14);
  EXPECT_NEAR(stats.logprob_gap_mean, gap_sum / 7, 1e-14);
  EXPECT_NEAR(stats.logprob_gap_max, gap_max, 1e-14);
  double k1 = 0;
  for (size_t t = 0; t < k.logp.size(); ++t) {
    if (t != 3) k1 += k.q[t] - k.logp[t];
  }
  EXPECT_NEAR(stats.kl_k1, k1 / 7, 1e-14);
  EXPECT_NEAR(stats.kl_k3, k3 / 7, 1e-14);
  // Without return_logprobs the logprobs only served the statistics.
  EXPECT_TRUE(result.samples[0].logprobs.empty());
  EXPECT_TRUE(result.samples[0].token_losses.empty());
}

TEST(PolicyLossTest, StatisticsOfPartsCombineToTheStatisticsOfTheWhole) {
  const Tokens k;
  // The whole sample, and its first 3 and last 5 tokens as two samples.
  Sample whole = ToSample(k);
  auto part = [&](size_t begin, size_t end) {
    Sample s;
    s.input_tokens.assign(whole.input_tokens.begin() + begin,
                          whole.input_tokens.begin() + end);
    s.target_tokens.assign(whole.target_tokens.begin() + begin,
                           whole.target_tokens.begin() + end);
    s.weights.assign(whole.weights.begin() + begin,
                     whole.weights.begin() + end);
    for (const char* name : {kAdvantages, kSamplingLogprobs}) {
      const std::vector<float>& v = whole.token_inputs.at(name);
      s.token_inputs[name].assign(v.begin() + begin, v.begin() + end);
    }
    return s;
  };
  const auto loss = MakeTokenLoss(ParseLossSpec("cispo", {}).value()).value();
  auto report = [&](std::vector<Sample> samples) {
    ForwardBackwardArgs args;
    args.samples = std::move(samples);
    ForwardBackwardResult result;
    size_t offset = 0;
    for (const Sample& s : args.samples) {
      result.samples.emplace_back();
      result.samples.back().logprobs.assign(
          k.logp.begin() + offset,
          k.logp.begin() + offset + s.input_tokens.size());
      offset += s.input_tokens.size();
    }
    ReportLoss(*loss, args, result);
    return *result.policy;
  };
  const PolicyStats one = report({whole});
  const PolicyStats two = report({part(0, 3), part(3, 8)});
  EXPECT_EQ(two.tokens, one.tokens);
  EXPECT_NEAR(two.ratio_mean, one.ratio_mean, 1e-14);
  EXPECT_EQ(two.ratio_min, one.ratio_min);
  EXPECT_EQ(two.ratio_max, one.ratio_max);
  EXPECT_NEAR(two.clipped_fraction, one.clipped_fraction, 1e-15);
  EXPECT_NEAR(two.logprob_gap_mean, one.logprob_gap_mean, 1e-14);
  EXPECT_EQ(two.logprob_gap_max, one.logprob_gap_max);
  EXPECT_NEAR(two.kl_k1, one.kl_k1, 1e-14);
  EXPECT_NEAR(two.kl_k3, one.kl_k3, 1e-14);
  // A sample without valid tokens changes nothing.
  EXPECT_EQ(CombinePolicyStats({PolicyStats{}, one}).ratio_min, one.ratio_min);
}

TEST(LossSpecTest, FillsDefaultsAndRefusesWhatNoLossReads) {
  const LossSpec ppo = ParseLossSpec("ppo", {}).value();
  EXPECT_EQ(ppo.settings.at("clip_low_threshold"), 0.8);
  EXPECT_EQ(ppo.settings.at("clip_high_threshold"), 1.2);
  EXPECT_EQ(ParseLossSpec("cispo", {{"clip_high_threshold", 1.28}})
                .value()
                .settings.at("clip_high_threshold"),
            1.28);
  EXPECT_EQ(LossNames(),
            (std::vector<std::string>{"cross_entropy", "importance_sampling",
                                      "ppo", "cispo", "dro"}));
  struct Bad {
    const char* loss;
    std::map<std::string, double> config;
    std::vector<const char*> message;
  };
  const std::vector<Bad> bad = {
      {"reinforce", {}, {"loss_fn", "reinforce", "cross_entropy, "}},
      {"ppo", {{"clip_epsilon", 0.2}}, {"clip_epsilon", "clip_low_threshold"}},
      {"cross_entropy", {{"beta", 1}}, {"beta", "it has none"}},
      {"dro", {}, {"loss_fn_config[\"beta\"] is required by the dro loss"}},
      {"dro", {{"beta", -1}}, {"beta", ">= 0"}},
      {"ppo",
       {{"clip_low_threshold", 1.3}},
       {"clip_low_threshold (1.3)", "clip_high_threshold (1.2)"}},
      {"cispo",
       {{"clip_high_threshold", NAN}},
       {"clip_high_threshold", "finite"}},
  };
  for (const Bad& b : bad) {
    const absl::StatusOr<LossSpec> spec = ParseLossSpec(b.loss, b.config);
    ASSERT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument)
        << b.loss;
    for (const char* part : b.message) {
      EXPECT_THAT(spec.status().message(), HasSubstr(part));
    }
  }
}

// The loss table: a row per LossId in id order, each name found again, and
// each id's factory builds the class of that name.
TEST(LossSpecTest, TheTableHasEveryLossOnceInIdOrder) {
  const std::vector<std::string> names = LossNames();
  ASSERT_EQ(names.size(), static_cast<size_t>(kNumLosses));
  for (int i = 0; i < kNumLosses; ++i) {
    const LossId id = static_cast<LossId>(i);
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(LossName(id), names[i]);
    EXPECT_EQ(LossIdOf(names[i]).value(), id);
    const LossSpec spec =
        ParseLossSpec(names[i], id == LossId::kDro
                                    ? std::map<std::string, double>{{"beta", 1}}
                                    : std::map<std::string, double>{})
            .value();
    EXPECT_EQ(MakeTokenLoss(spec).value()->name(), names[i]);
  }
  EXPECT_EQ(LossIdOf("reinforce").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The window rule on one rank: a window of samples split into one call or
// three gives the same gradient (fp64) for every loss and reduction; and a
// window whose calls use different losses under SUM has the sum of the
// gradients each call has alone.
class PolicyLossWindowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const int64_t vocab = testing::TinyConfig().vocab_size;
    samples_ = testing::MakeSamples(vocab, {9, 4, 0, 13, 6, 1}, 7);
    testing::AddPolicyInputs(samples_, -std::log(vocab), 8);
    engine_ = Engine::CreateSingleRank({}).value();
  }

  // The accumulated gradient after `calls` on a fresh model `id`.
  std::vector<torch::Tensor> Gradient(
      const std::string& id,
      const std::vector<std::pair<std::vector<int>, LossSpec>>& calls,
      LossReduction reduction) {
    EXPECT_TRUE(engine_
                    ->CreateModel(testing::TinySpec(id, DType::kFloat64,
                                                    OptimizerKind::kAdamW))
                    .ok());
    for (const auto& [indices, loss] : calls) {
      ForwardBackwardArgs args;
      for (int i : indices) args.samples.push_back(samples_[i]);
      args.reduction = reduction;
      args.loss = loss;
      EXPECT_TRUE(engine_->ForwardBackward(id, args).ok());
    }
    std::vector<torch::Tensor> grads;
    for (Parameter& p :
         EngineTestPeer::Model(*engine_, id).value()->parameters()) {
      grads.push_back(p.tensor.grad().clone());
    }
    return grads;
  }

  std::vector<Sample> samples_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(PolicyLossWindowTest, SplittingTheWindowChangesNothing) {
  int n = 0;
  for (const std::string& name : LossNames()) {
    const LossSpec loss =
        ParseLossSpec(name, name == "dro"
                                ? std::map<std::string, double>{{"beta", 0.2}}
                                : std::map<std::string, double>{})
            .value();
    for (LossReduction reduction :
         {LossReduction::kTokenMean, LossReduction::kSampleMean,
          LossReduction::kSum}) {
      SCOPED_TRACE(name + "/" + ReductionName(reduction));
      const auto one = Gradient(absl::StrCat("one", n),
                                {{{0, 1, 2, 3, 4, 5}, loss}}, reduction);
      const auto three =
          Gradient(absl::StrCat("three", n++),
                   {{{3}, loss}, {{0, 5}, loss}, {{1, 2, 4}, loss}}, reduction);
      for (size_t p = 0; p < one.size(); ++p) {
        EXPECT_LT(testing::RelativeDiff(three[p], one[p]), 1e-10) << p;
      }
    }
  }
}

TEST_F(PolicyLossWindowTest, AWindowMayMixLosses) {
  const LossSpec ce = ParseLossSpec("cross_entropy", {}).value();
  const LossSpec ppo = ParseLossSpec("ppo", {}).value();
  const LossSpec dro = ParseLossSpec("dro", {{"beta", 0.1}}).value();
  const LossReduction sum = LossReduction::kSum;
  const auto mixed =
      Gradient("mixed", {{{0, 1}, ce}, {{2, 3}, ppo}, {{4, 5}, dro}}, sum);
  const std::vector<std::vector<torch::Tensor>> alone = {
      Gradient("ce", {{{0, 1}, ce}}, sum),
      Gradient("ppo", {{{2, 3}, ppo}}, sum),
      Gradient("dro", {{{4, 5}, dro}}, sum)};
  for (size_t p = 0; p < mixed.size(); ++p) {
    const torch::Tensor want = alone[0][p] + alone[1][p] + alone[2][p];
    EXPECT_LT(testing::RelativeDiff(mixed[p], want), 1e-10) << p;
  }
}

}  // namespace
}  // namespace tally
