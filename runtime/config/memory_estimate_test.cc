// The memory estimates against reality: the closed-form parameter count
// equals the parameters a built model holds, and a trained model's
// parameters, gradients and optimizer state take exactly the resident bytes
// the estimate gives them on one rank.
#include "runtime/config/memory_estimate.h"

#include <gtest/gtest.h>

#include <iostream>
#include <vector>

#include "runtime/engine/engine.h"
#include "runtime/model/llama_model.h"
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
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
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

// A bfloat16 model on a tp mesh whose linears keep float32
// (TensorParallelInFloat32) is charged, per token of its largest
// micro-batch, 4 bytes for each float32 element the region keeps: per layer
// the attention's and the MLP's region inputs (hidden each; MoE: the
// attention's only) and rank for each adapted column-parallel projection
// (q, k, v, gate, up; not o, down), once the unembedding's input (hidden)
// and its adapter's rank. Derived here from the shapes, not from the code.
TEST(MemoryEstimateTest, Float32TensorParallelRegionIsCharged) {
  const LlamaConfig dense = testing::TinyConfig().WithDefaults();
  LlamaConfig moe = dense;
  moe.num_local_experts = 4;
  moe.num_experts_per_tok = 2;
  const torch::Device cpu(torch::kCPU);
  ASSERT_FALSE(TensorParallelInFloat32(1, DType::kBFloat16, cpu));
  ASSERT_FALSE(TensorParallelInFloat32(2, DType::kFloat32, cpu));
  const bool takes_it = TensorParallelInFloat32(2, DType::kBFloat16, cpu);
  if (!takes_it) {
    std::cout << "this build has no bf16 -> float32 matmul: tp2 bf16 keeps "
                 "LibTorch's linears and adds nothing\n";
  }
  const std::vector<int64_t> lengths = {5, 3};
  const double tokens = 10;  // two samples padded to the longest, 5
  LoraConfig none;
  LoraConfig full = testing::TestLora();  // every target, rank 4
  LoraConfig attn = full;
  attn.train_mlp = false;
  attn.train_unembed = false;
  struct Case {
    const char* name;
    const LlamaConfig& config;
    LoraConfig lora;
    bool checkpointing;
    double per_layer, once;  // float32 elements per token
  };
  const double h = dense.hidden_size, r = full.rank;
  const std::vector<Case> cases = {
      {"full model", dense, none, false, 2 * h, h},
      {"every target", dense, full, false, 2 * h + 5 * r, h + r},
      {"attention only", dense, attn, false, 2 * h + 3 * r, h},
      {"mixture of experts", moe, attn, false, h + 3 * r, h},
      {"checkpointing", dense, full, true, 2 * h + 5 * r, h + r},
  };
  for (const Case& c : cases) {
    const double layers = c.checkpointing ? 1 : c.config.num_hidden_layers;
    const double expected = takes_it ? kActivationMargin * tokens * 4 *
                                           (layers * c.per_layer + c.once)
                                     : 0;
    auto bytes = [&](int tp) {
      const TensorParallelRegion region{
          TensorParallelInFloat32(tp, DType::kBFloat16, cpu), c.lora};
      return CallActivationBytes(c.config, DType::kBFloat16, lengths, 16384, {},
                                 c.checkpointing, region);
    };
    EXPECT_DOUBLE_EQ(bytes(2) - bytes(1), expected) << c.name;
  }
}

}  // namespace
}  // namespace tally
