// Accumulation-window semantics of the engine: what ForwardBackward,
// OptimStep, AbortAccumulation and LoadCheckpoint may and may not change.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "runtime/engine/engine.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::AllEqual;
using testing::Gradients;
using testing::MakeSamples;
using testing::ParameterValues;
using testing::RelativeDiff;
using testing::TinySpec;

constexpr int64_t kVocab = 48;

class EngineSemanticsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = Engine::CreateSingleRank({}).value();
    ASSERT_TRUE(
        engine_
            ->CreateModel(TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW))
            .ok());
  }
  CausalLm& model() { return *EngineTestPeer::Model(*engine_, "m").value(); }
  absl::Status Train(const std::vector<int>& valid, uint64_t seed,
                     LossReduction reduction = LossReduction::kTokenMean) {
    return engine_
        ->ForwardBackward("m", {MakeSamples(kVocab, valid, seed), reduction})
        .status();
  }
  double ForwardLoss() {
    ForwardBackwardArgs args{MakeSamples(kVocab, {5, 9}, 999)};
    args.forward_only = true;
    return engine_->ForwardBackward("m", args)->loss_sum;
  }

  std::unique_ptr<Engine> engine_;
};

TEST_F(EngineSemanticsTest, ForwardBackwardNeverZeroesEarlierGradients) {
  ASSERT_TRUE(Train({4, 6}, 1).ok());
  const auto after_first = Gradients(model());
  ASSERT_TRUE(Train({8}, 2).ok());
  const auto after_both = Gradients(model());
  // The second call's own gradient, from a fresh window.
  ASSERT_TRUE(engine_->AbortAccumulation("m").ok());
  ASSERT_TRUE(Train({8}, 2).ok());
  const auto second_alone = Gradients(model());
  for (size_t i = 0; i < after_both.size(); ++i) {
    EXPECT_LT(RelativeDiff(after_both[i], after_first[i] + second_alone[i]),
              1e-12);
  }
  EXPECT_GT(RelativeDiff(after_both[0], second_alone[0]), 1e-3);
}

TEST_F(EngineSemanticsTest, ForwardOnlyAccumulatesNothing) {
  const double loss = ForwardLoss();
  EXPECT_GT(loss, 0);
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 0);
  for (const auto& g : Gradients(model()))
    EXPECT_EQ(g.abs().sum().item<double>(), 0);
}

TEST_F(EngineSemanticsTest, LogprobsComeBackPerPositionZeroWhereIgnored) {
  ForwardBackwardArgs args{MakeSamples(kVocab, {3, 7}, 5)};
  args.forward_only = true;
  args.return_logprobs = true;
  auto result = engine_->ForwardBackward("m", args).value();
  ASSERT_EQ(result.samples.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    const Sample& sample = args.samples[s];
    const auto& lp = result.samples[s].logprobs;
    ASSERT_EQ(lp.size(), sample.input_tokens.size());
    double weighted = 0;
    for (size_t t = 0; t < lp.size(); ++t) {
      if (sample.target_tokens[t] == kIgnoreIndex) {
        EXPECT_EQ(lp[t], 0.0);
      } else {
        EXPECT_LT(lp[t], 0.0);
        weighted += -lp[t] * sample.weights[t];
      }
    }
    EXPECT_LT(RelativeDiff(weighted, result.samples[s].loss_sum), 1e-12);
  }
}

TEST_F(EngineSemanticsTest, MixedReductionsAreRefusedWithNothingChanged) {
  ASSERT_TRUE(Train({4}, 1, LossReduction::kTokenMean).ok());
  const auto grads = Gradients(model());
  absl::Status status = Train({4}, 2, LossReduction::kSampleMean);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("token_mean"), std::string::npos);
  EXPECT_TRUE(AllEqual(grads, Gradients(model())));
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 1);
  // forward_only does not join the window, so any reduction is fine.
  ForwardBackwardArgs probe{MakeSamples(kVocab, {2}, 3),
                            LossReduction::kSampleMean};
  probe.forward_only = true;
  EXPECT_TRUE(engine_->ForwardBackward("m", probe).ok());
}

TEST_F(EngineSemanticsTest, ZeroNormalizerIsRefusedWithNothingChanged) {
  const auto params = ParameterValues(model());
  EXPECT_EQ(engine_->OptimStep("m", {}).status().code(),
            absl::StatusCode::kFailedPrecondition);  // nothing accumulated
  ASSERT_TRUE(Train({0, 0}, 1).ok());                // every token ignored
  auto step = engine_->OptimStep("m", {});
  EXPECT_EQ(step.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(AllEqual(params, ParameterValues(model())));
  EXPECT_EQ(engine_->GetModel("m")->step, 0);
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 1);  // kept
  // Adding real data to the same window then steps normally.
  ASSERT_TRUE(Train({3}, 2).ok());
  auto ok = engine_->OptimStep("m", {});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->normalizer, 3.0);
}

TEST_F(EngineSemanticsTest, AbortAccumulationDiscardsTheWindow) {
  ASSERT_TRUE(Train({4, 2}, 1).ok());
  ASSERT_TRUE(Train({1}, 2).ok());
  WindowCounts discarded = engine_->AbortAccumulation("m").value();
  EXPECT_EQ(discarded.calls, 2);
  EXPECT_EQ(discarded.tokens, 7);
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 0);
  for (const auto& g : Gradients(model()))
    EXPECT_EQ(g.abs().sum().item<double>(), 0);
  // A new window with another reduction is now allowed.
  EXPECT_TRUE(Train({2}, 3, LossReduction::kSum).ok());
}

TEST_F(EngineSemanticsTest, LoadCheckpointClearsThePendingWindow) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("tally_load_clears_" + std::to_string(getpid())))
                              .string();
  ASSERT_TRUE(Train({3}, 1).ok());
  ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
  ASSERT_TRUE(engine_->SaveCheckpoint("m", dir).ok());
  const auto saved = ParameterValues(model());
  ASSERT_TRUE(Train({4, 4}, 2).ok());
  ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
  ASSERT_TRUE(Train({5}, 3).ok());  // pending when loading
  auto loaded = engine_->LoadCheckpoint("m", dir, /*load_optimizer=*/true);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->discarded.calls, 1);
  EXPECT_EQ(loaded->discarded.tokens, 5);
  EXPECT_EQ(loaded->model.window.calls, 0);
  EXPECT_EQ(loaded->model.step, 1);
  EXPECT_TRUE(AllEqual(saved, ParameterValues(model())));
  for (const auto& g : Gradients(model()))
    EXPECT_EQ(g.abs().sum().item<double>(), 0);
  std::filesystem::remove_all(dir);
}

TEST_F(EngineSemanticsTest, InitCheckpointStartsFromTheSavedWeights) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("tally_init_ckpt_" + std::to_string(getpid())))
                              .string();
  ASSERT_TRUE(Train({3, 2}, 1).ok());
  ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
  ASSERT_TRUE(engine_->SaveCheckpoint("m", dir).ok());

  ModelSpec spec = TinySpec("copy", DType::kFloat64, OptimizerKind::kSgd, 99);
  spec.config = LlamaConfig();  // taken from the checkpoint's config.json
  spec.init_checkpoint = dir;
  auto copy = engine_->CreateModel(spec);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(copy->config, testing::TinyConfig().WithDefaults());
  EXPECT_EQ(copy->step, 0);  // fresh optimizer, weights only
  EXPECT_TRUE(AllEqual(
      ParameterValues(model()),
      ParameterValues(*EngineTestPeer::Model(*engine_, "copy").value())));

  // A config sent alongside must agree with the checkpoint's.
  spec.model_id = "mismatch";
  spec.config = testing::TinyConfig();
  spec.config.rope_theta = 500000;
  EXPECT_EQ(engine_->CreateModel(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(engine_->GetModel("mismatch").ok());
  std::filesystem::remove_all(dir);
}

class NonFiniteTest : public EngineSemanticsTest {
 protected:
  // One real step first, so the optimizer moments are non-zero.
  void SetUp() override {
    EngineSemanticsTest::SetUp();
    ASSERT_TRUE(Train({6, 3}, 1).ok());
    ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
    ASSERT_TRUE(Train({5}, 2).ok());
    model().parameters()[2].tensor.mutable_grad()[1][1] = NAN;
    params_ = ParameterValues(model());
    ASSERT_TRUE(
        engine_->SaveCheckpoint("m", StateDir("before"), kAllowPending).ok());
  }
  std::string StateDir(const std::string& name) {
    return (std::filesystem::temp_directory_path() /
            ("tally_nonfinite_" + std::to_string(getpid()) + "_" + name))
        .string();
  }
  void ExpectOptimizerStateUnchanged() {
    // Saving writes the live moments: byte-identical files mean identical
    // optimizer state.
    ASSERT_TRUE(
        engine_->SaveCheckpoint("m", StateDir("after"), kAllowPending).ok());
    for (const char* file : {"optimizer.safetensors", "model.safetensors"}) {
      std::ifstream a(StateDir("before") + "/" + file, std::ios::binary);
      std::ifstream b(StateDir("after") + "/" + file, std::ios::binary);
      std::string sa((std::istreambuf_iterator<char>(a)), {});
      std::string sb((std::istreambuf_iterator<char>(b)), {});
      EXPECT_FALSE(sa.empty());
      EXPECT_EQ(sa, sb) << file;
    }
  }
  void TearDown() override {
    std::filesystem::remove_all(StateDir("before"));
    std::filesystem::remove_all(StateDir("after"));
  }
  // The window is pending here; only the weights and moments are compared.
  const SaveOptions kAllowPending{/*allow_pending=*/true, ""};
  std::vector<torch::Tensor> params_;
};

TEST_F(NonFiniteTest, SkipLeavesEverythingBitwiseUnchangedAndClearsWindow) {
  OptimStepArgs args;
  args.nonfinite = NonFinitePolicy::kSkip;
  auto result = engine_->OptimStep("m", args);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->skipped);
  EXPECT_TRUE(std::isnan(result->grad_norm));
  EXPECT_NE(result->skip_reason.find("non-finite"), std::string::npos);
  EXPECT_EQ(result->step, 1);
  EXPECT_TRUE(AllEqual(params_, ParameterValues(model())));
  ExpectOptimizerStateUnchanged();
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 0);
}

TEST_F(NonFiniteTest, ErrorChangesNothingAndKeepsTheWindow) {
  OptimStepArgs args;
  args.nonfinite = NonFinitePolicy::kError;
  auto result = engine_->OptimStep("m", args);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(AllEqual(params_, ParameterValues(model())));
  ExpectOptimizerStateUnchanged();
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 1);
  EXPECT_EQ(engine_->GetModel("m")->step, 1);
}

TEST(AdamWTest, MatchesTorchOptimAdamWWithPerStepHyperparameters) {
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    torch::manual_seed(7);
    torch::Tensor a = torch::randn({5, 3}, dtype).requires_grad_();
    torch::Tensor b = torch::randn({4}, dtype).requires_grad_();
    std::vector<Parameter> params = {
        {"a", a.detach().clone().requires_grad_(), {}, false},
        {"b", b.detach().clone().requires_grad_(), {}, false}};
    Optimizer ours(OptimizerKind::kAdamW, &params);
    torch::optim::AdamW theirs({a, b});
    const AdamParams schedule[] = {{1e-2, 0.9, 0.999, 1e-8, 0.01},
                                   {5e-3, 0.8, 0.99, 1e-6, 0.0},
                                   {2e-2, 0.95, 0.9, 1e-8, 0.3},
                                   {0.0, 0.9, 0.999, 1e-8, 0.1}};
    for (const AdamParams& hp : schedule) {
      torch::Tensor ga = torch::randn({5, 3}, dtype);
      torch::Tensor gb = torch::randn({4}, dtype);
      a.mutable_grad() = ga.clone();
      b.mutable_grad() = gb.clone();
      params[0].tensor.mutable_grad() = ga.clone();
      params[1].tensor.mutable_grad() = gb.clone();
      auto& options = static_cast<torch::optim::AdamWOptions&>(
          theirs.param_groups()[0].options());
      options.lr(hp.learning_rate)
          .betas({hp.beta1, hp.beta2})
          .eps(hp.eps)
          .weight_decay(hp.weight_decay);
      theirs.step();
      ASSERT_TRUE(ours.Step(hp).ok());
      EXPECT_TRUE(torch::equal(params[0].tensor, a)) << dtype;
      EXPECT_TRUE(torch::equal(params[1].tensor, b)) << dtype;
    }
    EXPECT_EQ(ours.step_count(), 4);
  }
}

}  // namespace
}  // namespace tally
