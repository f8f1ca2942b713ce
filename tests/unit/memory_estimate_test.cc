// The memory estimates against reality: the closed-form parameter count
// equals the parameters a built model holds, and a trained model's
// parameters, gradients and optimizer state take exactly the resident bytes
// the estimate gives them on one rank.
#include "runtime/memory_estimate.h"

#include <gtest/gtest.h>

#include "runtime/engine.h"
#include "runtime/llama_model.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

TEST(MemoryEstimateTest, ParameterCountIsWhatAModelHolds) {
  std::vector<LlamaConfig> configs = {testing::TinyConfig(),
                                      LlamaConfig::EmbeddedDefault()};
  LlamaConfig tied = testing::TinyConfig();
  tied.tie_word_embeddings = !tied.tie_word_embeddings;
  configs.push_back(tied);
  LlamaConfig moe = testing::TinyConfig();
  moe.num_local_experts = 4;
  moe.num_experts_per_tok = 2;
  configs.push_back(moe);
  for (const LlamaConfig& raw : configs) {
    const LlamaConfig config = raw.WithDefaults();
    absl::StatusOr<std::unique_ptr<LlamaModel>> model =
        LlamaModel::Create(config, DType::kFloat32, 1);
    ASSERT_TRUE(model.ok()) << model.status();
    double held = 0;
    for (const Parameter& p : (*model)->parameters()) held += p.tensor.numel();
    EXPECT_EQ(ParameterCount(config), held);
    EXPECT_EQ(ParameterCount(config),
              static_cast<double>(config.NumParameters()));
  }
}

TEST(MemoryEstimateTest, ResidentBytesAreWhatATrainedModelTakes) {
  auto engine = Engine::CreateSingleRank({}).value();
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    for (OptimizerKind optimizer :
         {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
      ModelSpec spec = testing::TinySpec("m", dtype, optimizer);
      ASSERT_TRUE(engine->CreateModel(spec).ok());
      ASSERT_TRUE(
          engine
              ->ForwardBackward("m", {testing::MakeSamples(
                                         spec.config.vocab_size, {5, 3}, 1)})
              .ok());
      const absl::StatusOr<OptimStepResult> step = engine->OptimStep("m", {});
      ASSERT_TRUE(step.ok()) << step.status();
      const double taken = step->metrics.at("rank_param_bytes") +
                           step->metrics.at("rank_grad_bytes") +
                           step->metrics.at("rank_optimizer_bytes");
      EXPECT_EQ(
          ModelResidentBytes(spec.config.WithDefaults(), dtype, optimizer, 1),
          taken);
      ASSERT_TRUE(engine->DeleteModel("m").ok());
    }
  }
}

// Admission charges what each ZeRO stage keeps under dp_shard: stage 3
// the parameters gathered for a pass, stage 2 the same copy kept between
// steps, stage 1 also the whole gradients; without dp_shard the stage
// changes nothing.
TEST(MemoryEstimateTest, ZeroStagesChargeWhatTheyKeep) {
  const LlamaConfig config = testing::TinyConfig().WithDefaults();
  const double params = ParameterCount(config) * sizeof(float);
  auto bytes = [&](int dp_shard, ZeroStage stage) {
    return ModelResidentBytes(config, DType::kFloat32, OptimizerKind::kAdamW,
                              dp_shard, stage);
  };
  for (ZeroStage stage : {ZeroStage::kOptimizerState, ZeroStage::kGradients}) {
    EXPECT_EQ(bytes(1, stage), bytes(1, ZeroStage::kParameters));
  }
  EXPECT_EQ(bytes(4, ZeroStage::kParameters), 4 * params / 4 + params);
  EXPECT_EQ(bytes(4, ZeroStage::kGradients), bytes(4, ZeroStage::kParameters));
  EXPECT_EQ(bytes(4, ZeroStage::kOptimizerState),
            bytes(4, ZeroStage::kGradients) + params);
}

}  // namespace
}  // namespace tally
