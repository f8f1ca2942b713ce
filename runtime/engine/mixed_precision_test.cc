// bf16 mixed precision (DType::kBFloat16): float32 master parameters,
// gradients and optimizer state, bfloat16 matmuls and activations. The
// contract: a window's calls sum their raw gradients in float32 (exactly as
// float32 addition would), and a bf16 model tracks the float32 model of the
// same seed within bf16's rounding, step after step. The multi-rank form is
// MixedPrecisionGoldenTest (multirank_golden_test.cc).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"
#include "server/convert.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;
using testing::MakeSamples;
using testing::RelativeDiff;
using testing::TinySpec;

// The bf16 <-> float32 distance the 20-step curve stays within. Measured:
// window losses within 3e-4 relative, norms within 1.5e-2 (bf16 keeps 8
// significant bits; a norm sums many rounded squares).
constexpr double kLossTolerance = 1e-2;
constexpr double kNormTolerance = 3e-2;

ModelSpec Spec(const std::string& id, DType dtype) {
  ModelSpec spec = TinySpec(id, dtype, OptimizerKind::kAdamW);
  spec.default_adam.learning_rate = 3e-3;
  spec.default_max_grad_norm = 1.0;
  return spec;
}

TEST(MixedPrecisionTest, MastersAndGradientsStayFloat32) {
  auto engine = Engine::CreateSingleRank({}).value();
  auto created = engine->CreateModel(Spec("m", DType::kBFloat16));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->dtype, DType::kBFloat16);
  CausalLm& model = *EngineTestPeer::Model(*engine, "m").value();
  EXPECT_EQ(model.compute_type(), torch::kBFloat16);
  const int64_t vocab = model.config().vocab_size;
  ASSERT_TRUE(
      engine->ForwardBackward("m", {MakeSamples(vocab, {6, 9}, 3)}).ok());
  for (const Parameter& p : model.parameters()) {
    EXPECT_EQ(p.tensor.scalar_type(), torch::kFloat32) << p.name;
    ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
    EXPECT_EQ(p.tensor.grad().scalar_type(), torch::kFloat32) << p.name;
  }
}

// The window rule in mixed precision: two calls' raw gradients add in
// float32, bitwise as adding the two calls' gradients taken apart.
TEST(MixedPrecisionTest, AWindowSumsItsCallsInFloat32) {
  auto engine = Engine::CreateSingleRank({}).value();
  for (const char* id : {"a", "b", "ab"}) {
    ASSERT_TRUE(engine->CreateModel(Spec(id, DType::kBFloat16)).ok());
  }
  const int64_t vocab =
      EngineTestPeer::Model(*engine, "a").value()->config().vocab_size;
  const std::vector<Sample> first = MakeSamples(vocab, {7, 3}, 21);
  const std::vector<Sample> second = MakeSamples(vocab, {12}, 22);
  ASSERT_TRUE(engine->ForwardBackward("a", {first}).ok());
  ASSERT_TRUE(engine->ForwardBackward("b", {second}).ok());
  ASSERT_TRUE(engine->ForwardBackward("ab", {first}).ok());
  ASSERT_TRUE(engine->ForwardBackward("ab", {second}).ok());
  const auto a =
      testing::Gradients(*EngineTestPeer::Model(*engine, "a").value());
  const auto b =
      testing::Gradients(*EngineTestPeer::Model(*engine, "b").value());
  const auto ab =
      testing::Gradients(*EngineTestPeer::Model(*engine, "ab").value());
  ASSERT_EQ(a.size(), ab.size());
  for (size_t i = 0; i < ab.size(); ++i) {
    EXPECT_TRUE(torch::equal(ab[i], a[i] + b[i])) << i;
  }
}

// 20 windows (4 batches in turn, clipped AdamW at lr 3e-3) on a float32 and
// a bf16 model of one seed: every window's loss within kLossTolerance, every
// norm within kNormTolerance, and both learn (the first batch's loss at its
// fifth pass against its first).
TEST(MixedPrecisionTest, TwentyStepLossCurveTracksFloat32) {
  auto engine = Engine::CreateSingleRank({}).value();
  ASSERT_TRUE(engine->CreateModel(Spec("f32", DType::kFloat32)).ok());
  ASSERT_TRUE(engine->CreateModel(Spec("bf16", DType::kBFloat16)).ok());
  const int64_t vocab =
      EngineTestPeer::Model(*engine, "f32").value()->config().vocab_size;
  std::vector<std::vector<double>> curves(2);
  for (int step = 0; step < 20; ++step) {
    SCOPED_TRACE(step);
    const std::vector<Sample> batch =
        MakeSamples(vocab, {24, 17, 30}, 100 + step % 4);
    std::vector<double> norms;
    for (int m = 0; m < 2; ++m) {
      const char* id = m == 0 ? "f32" : "bf16";
      auto fb = engine->ForwardBackward(id, {batch});
      ASSERT_TRUE(fb.ok()) << fb.status();
      auto stepped = engine->OptimStep(id, {});
      ASSERT_TRUE(stepped.ok()) << stepped.status();
      ASSERT_FALSE(stepped->skipped);
      curves[m].push_back(fb->loss_mean);
      norms.push_back(stepped->grad_norm);
    }
    EXPECT_LT(RelativeDiff(curves[1].back(), curves[0].back()), kLossTolerance);
    EXPECT_LT(RelativeDiff(norms[1], norms[0]), kNormTolerance);
  }
  for (const std::vector<double>& curve : curves) {
    EXPECT_LT(curve[16], 0.9 * curve[0]);
  }
}

TEST(MixedPrecisionTest, CheckpointsKeepTheMastersAndReloadExactly) {
  auto engine = Engine::CreateSingleRank({}).value();
  ASSERT_TRUE(engine->CreateModel(Spec("m", DType::kBFloat16)).ok());
  CausalLm& model = *EngineTestPeer::Model(*engine, "m").value();
  const int64_t vocab = model.config().vocab_size;
  ASSERT_TRUE(engine->ForwardBackward("m", {MakeSamples(vocab, {9}, 5)}).ok());
  ASSERT_TRUE(engine->OptimStep("m", {}).ok());
  const std::string dir = ::testing::TempDir() + "/mixed_precision_ckpt";
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(engine->SaveCheckpoint("m", dir, {}).ok());
  const auto saved = testing::ParameterValues(model);

  ModelSpec reloaded = Spec("r", DType::kBFloat16);
  reloaded.config = LlamaConfig();
  reloaded.init_checkpoint = dir;
  auto created = engine->CreateModel(reloaded);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(testing::AllEqual(
      saved,
      testing::ParameterValues(*EngineTestPeer::Model(*engine, "r").value())))
      << "float32 masters, not their bf16 copies";
}

// Cast once: the bf16 copies a model keeps between calls follow its
// masters. After an OptimStep (the fused kernels) and after a
// LoadCheckpoint, a call reads the new weights: its log-probabilities are
// those of a model freshly created from the same masters.
TEST(MixedPrecisionTest, CallsReadTheWeightsOfTheLastStepOrLoad) {
  auto engine = Engine::CreateSingleRank({}).value();
  ASSERT_TRUE(engine->CreateModel(Spec("m", DType::kBFloat16)).ok());
  const int64_t vocab =
      EngineTestPeer::Model(*engine, "m").value()->config().vocab_size;
  const LogprobsArgs prompts{{{3, 1, 4, 1, 5, 9, 2, 6}, {2, 7}}};
  const auto logprobs = [&](const std::string& id) {
    absl::StatusOr<LogprobsCallResult> r = engine->ComputeLogprobs(id, prompts);
    EXPECT_TRUE(r.ok()) << r.status();
    std::vector<double> all;
    for (const PromptLogprobs& p : r->prompts) {
      all.insert(all.end(), p.logprobs.begin(), p.logprobs.end());
    }
    return all;
  };
  const auto created_from = [&](const std::string& id, const std::string& dir) {
    ModelSpec spec = Spec(id, DType::kBFloat16);
    spec.config = LlamaConfig();
    spec.init_checkpoint = dir;
    absl::StatusOr<ModelSummary> created = engine->CreateModel(spec);
    EXPECT_TRUE(created.ok()) << created.status();
  };
  const std::string dir = ::testing::TempDir() + "/cast_once_";
  std::filesystem::remove_all(dir + "0");
  ASSERT_TRUE(engine->SaveCheckpoint("m", dir + "0", {}).ok());
  const std::vector<double> initial = logprobs("m");
  for (int step = 1; step <= 2; ++step) {
    ASSERT_TRUE(
        engine->ForwardBackward("m", {MakeSamples(vocab, {9, 4}, step)}).ok());
    ASSERT_TRUE(engine->OptimStep("m", {}).ok());
    const std::string saved = dir + std::to_string(step);
    std::filesystem::remove_all(saved);
    ASSERT_TRUE(engine->SaveCheckpoint("m", saved, {}).ok());
    created_from("fresh" + std::to_string(step), saved);
    const std::vector<double> stepped = logprobs("m");
    EXPECT_NE(stepped, initial);
    EXPECT_EQ(stepped, logprobs("fresh" + std::to_string(step)));
  }
  ASSERT_TRUE(engine->LoadCheckpoint("m", dir + "0", false).ok());
  EXPECT_EQ(logprobs("m"), initial);
}

// Through the API: CreateModel's DTYPE_BFLOAT16 is a mixed-precision model
// and ModelInfo says so.
TEST(MixedPrecisionTest, TheApiCallsItDtypeBfloat16) {
  v1::CreateModelRequest request;
  request.set_model_id("m");
  request.set_dtype(v1::DTYPE_BFLOAT16);
  absl::StatusOr<ModelSpec> spec = ParseCreateModel(request);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->dtype, DType::kBFloat16);
  ModelSummary summary;
  summary.dtype = DType::kBFloat16;
  v1::ModelInfo info;
  ToProto(summary, &info);
  EXPECT_EQ(info.dtype(), v1::DTYPE_BFLOAT16);
}

TEST(MixedPrecisionTest, MixtureOfExpertsRefusesIt) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec = Spec("moe", DType::kBFloat16);
  spec.config.model_type = "mixtral";
  spec.config.num_local_experts = 4;
  spec.config.num_experts_per_tok = 2;
  const auto created = engine->CreateModel(spec);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(created.status().message(), HasSubstr("DTYPE_BFLOAT16"));
}

}  // namespace
}  // namespace tally
