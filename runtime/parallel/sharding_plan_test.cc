// The sharding plan as data: rule matching, the Llama family's plan covering
// every parameter it declares, and which pipeline stage owns each HF name.
#include "runtime/parallel/sharding_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "runtime/model/llama_model.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

TEST(ShardingPlanTest, AStarMatchesOneComponentOfDigits) {
  ShardingPlan plan;
  plan.rules = {
      {"model.layers.*.mlp.up_proj.weight", ParallelStyle::kColumnwise},
      {"model.norm.weight", ParallelStyle::kReplicate}};
  for (const std::string name : {"model.layers.0.mlp.up_proj.weight",
                                 "model.layers.31.mlp.up_proj.weight"}) {
    absl::StatusOr<const PlanRule*> rule = plan.RuleFor(name);
    ASSERT_TRUE(rule.ok()) << name << ": " << rule.status();
    EXPECT_EQ((*rule)->style, ParallelStyle::kColumnwise) << name;
  }
  EXPECT_EQ((*plan.RuleFor("model.norm.weight"))->style,
            ParallelStyle::kReplicate);
  for (const std::string name :
       {"model.layers..mlp.up_proj.weight", "model.layers.x.mlp.up_proj.weight",
        "model.layers.1.2.mlp.up_proj.weight",
        "model.layers.1.mlp.up_proj.weight.extra", "model.norm"}) {
    absl::StatusOr<const PlanRule*> rule = plan.RuleFor(name);
    EXPECT_EQ(rule.status().code(), absl::StatusCode::kInternal) << name;
    EXPECT_THAT(std::string(rule.status().message()), HasSubstr(name));
  }
}

TEST(ShardingPlanTest, OnOneDeviceEveryParameterIsReplicatedAndWhole) {
  const Parameter p =
      PlaceParameter("w", {6, 4}, {"w", ParallelStyle::kRowwise}, {});
  for (int d = 0; d < kNumMeshDims; ++d) {
    EXPECT_FALSE(p.placements.at(static_cast<MeshDim>(d)).is_shard()) << d;
  }
  EXPECT_EQ(p.tp_local_shape, std::vector<int64_t>({6, 4}));
  const Parameter expert =
      PlaceParameter("e", {2, 6, 4}, {"e", ParallelStyle::kExpert}, {});
  EXPECT_TRUE(expert.is_expert);
  // Experts are always split over ep (a one-rank split here).
  EXPECT_TRUE(expert.placements.at(MeshDim::kEp).is_shard());
}

TEST(ShardingPlanTest, PipelineStagesShardAllButASharedParameter) {
  ModelSharding staged;
  staged.pp_stages = 2;
  EXPECT_TRUE(PlaceParameter("w", {4}, {"w", ParallelStyle::kReplicate}, staged)
                  .placements.at(MeshDim::kPp)
                  .is_shard());
  EXPECT_FALSE(PlaceParameter("w", {4},
                              {"w", ParallelStyle::kColumnwise,
                               /*shared_across_stages=*/true},
                              staged)
                   .placements.at(MeshDim::kPp)
                   .is_shard());
}

TEST(LlamaShardingPlanTest, CoversEveryParameterOfEveryVariant) {
  LlamaConfig moe = testing::TinyConfig();
  moe.num_local_experts = 4;
  moe.num_experts_per_tok = 2;
  for (const LlamaConfig& config :
       {testing::TinyConfig(false), testing::TinyConfig(true), moe}) {
    absl::StatusOr<std::unique_ptr<LlamaModel>> model =
        LlamaModel::Create(config, DType::kFloat64, 1);
    ASSERT_TRUE(model.ok()) << model.status();
    const ShardingPlan plan = LlamaShardingPlan(config);
    for (const Parameter& p : (*model)->parameters()) {
      EXPECT_TRUE(plan.RuleFor(p.name).ok()) << p.name;
    }
  }
}

TEST(LlamaShardingPlanTest, MatricesSplitTheMegatronWay) {
  const ShardingPlan plan = LlamaShardingPlan(testing::TinyConfig());
  auto style = [&](const std::string& name) {
    return (*plan.RuleFor(name))->style;
  };
  EXPECT_EQ(style("model.layers.3.self_attn.q_proj.weight"),
            ParallelStyle::kColumnwise);
  EXPECT_EQ(style("model.layers.3.self_attn.o_proj.weight"),
            ParallelStyle::kRowwise);
  EXPECT_EQ(style("model.layers.3.mlp.down_proj.weight"),
            ParallelStyle::kRowwise);
  EXPECT_EQ(style("model.embed_tokens.weight"), ParallelStyle::kColumnwise);
  EXPECT_EQ(style("model.layers.0.input_layernorm.weight"),
            ParallelStyle::kReplicate);
  EXPECT_FALSE(
      (*plan.RuleFor("model.embed_tokens.weight"))->shared_across_stages);
  EXPECT_TRUE((*LlamaShardingPlan(testing::TinyConfig(true))
                    .RuleFor("model.embed_tokens.weight"))
                  ->shared_across_stages);
}

TEST(LlamaModelTest, OwningStage) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Create(testing::TinyConfig(false, 7), DType::kFloat32, 1);
  ASSERT_TRUE(model.ok()) << model.status();
  const CausalLm& m = **model;
  EXPECT_EQ(m.OwningStage("model.embed_tokens.weight", 3), 0);
  EXPECT_EQ(m.OwningStage("model.layers.2.mlp.up_proj.weight", 3), 0);
  EXPECT_EQ(m.OwningStage("model.layers.3.input_layernorm.weight", 3), 1);
  EXPECT_EQ(m.OwningStage("model.layers.6.self_attn.q_proj.weight", 3), 2);
  EXPECT_EQ(m.OwningStage("model.norm.weight", 3), 2);
  EXPECT_EQ(m.OwningStage("lm_head.weight", 3), 2);
  EXPECT_EQ(m.OwningStage("model.layers.7.mlp.up_proj.weight", 3), -1);
  EXPECT_EQ(m.OwningStage("model.layers.x.mlp.up_proj.weight", 3), -1);
  EXPECT_EQ(m.OwningStage("model.rotary_emb.inv_freq", 3), -1);
}

}  // namespace
}  // namespace tally
