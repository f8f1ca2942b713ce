// GradientSync (runtime/train/gradient_sync.h): what a built model sums across
// ranks before a step, decided from the mesh and the model. Each case states
// what its mesh implies — replicas hold partial gradients of the same
// shards, ZeRO-1 keeps whole gradients until they are reduced, the two ends
// of a pipeline hold copies of a tied embedding — and checks the decision
// and the sums against it.
#include "runtime/train/gradient_sync.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/mesh.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

absl::StatusOr<std::unique_ptr<Engine>> RankEngine(const MeshShape& shape,
                                                   const RankEnv& env) {
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
  TALLY_ASSIGN_OR_RETURN(auto groups,
                         ProcessGroups::Create(env, mesh, absl::Seconds(60)));
  return Engine::Create({}, mesh, std::move(groups));
}

// The sync of model `id`, built on `engine` from `spec`.
absl::StatusOr<GradientSync*> Build(Engine& engine, ModelSpec spec) {
  TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
  TALLY_ASSIGN_OR_RETURN(BuiltModel * built,
                         EngineTestPeer::Built(engine, spec.model_id));
  return &built->gradient_sync();
}

std::set<std::string> Names(const std::vector<Parameter>& params,
                            bool trainable_only) {
  std::set<std::string> names;
  for (const Parameter& p : params) {
    if (p.trainable || !trainable_only) names.insert(p.name);
  }
  return names;
}

// Every parameter's gradient set to `value`.
void FillGradients(CausalLm& model, double value) {
  torch::NoGradGuard no_grad;
  for (Parameter& p : model.parameters()) {
    if (p.trainable)
      p.tensor.mutable_grad() = torch::full_like(p.tensor, value);
  }
}

// Whether every trainable parameter's gradient is `value` everywhere.
bool AllGradientsAre(const CausalLm& model, double value) {
  for (const Parameter& p : model.parameters()) {
    if (!p.trainable) continue;
    const torch::Tensor& g = p.tensor.grad();
    if (!g.defined() || !g.eq(value).all().item<bool>()) return false;
  }
  return true;
}

TEST(GradientSyncTest, OneRankSumsNothing) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec =
      testing::TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW);
  spec.config = testing::MoeConfig(testing::TinyConfig(/*tied=*/true));
  GradientSync* sync = Build(*engine, spec).value();
  EXPECT_FALSE(sync->needed());
  EXPECT_FALSE(sync->reduces_whole_gradients());
  EXPECT_TRUE(sync->replica_sets().empty());
  EXPECT_EQ(sync->tied_embedding(), nullptr);
}

// dp_replicate = 2: both ranks hold every parameter, each with the gradient
// of its own samples. Every trainable parameter sums over the replicas, no
// frozen one; a DEFERRED window sums what it holds, an EAGER call only its
// own share (the earlier calls' are already sums).
TEST(GradientSyncTest, ReplicasSumEveryTrainableParameter) {
  MeshShape shape;
  shape.dp_replicate = 2;
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine, RankEngine(shape, env));
    ModelSpec spec =
        testing::TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW);
    spec.frozen = {"model.layers.*.mlp.up_proj.weight"};
    TALLY_ASSIGN_OR_RETURN(GradientSync * sync, Build(*engine, spec));
    TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                           EngineTestPeer::Model(*engine, "m"));
    EXPECT_TRUE(sync->needed());
    EXPECT_FALSE(sync->reduces_whole_gradients());
    EXPECT_EQ(sync->tied_embedding(), nullptr);
    EXPECT_EQ(sync->replica_sets().size(), 1u);
    if (sync->replica_sets().size() != 1) return absl::OkStatus();
    const GradientSet& set = sync->replica_sets()[0];
    EXPECT_EQ(set.group, engine->groups().replicas);
    const std::set<std::string> trainable =
        Names(model->parameters(), /*trainable_only=*/true);
    EXPECT_EQ(Names(set.parameters, false), trainable);
    EXPECT_LT(trainable.size(), model->parameters().size());

    // Rank r holds r + 1: the sum is 1 + 2 on both.
    FillGradients(*model, env.rank + 1);
    TALLY_RETURN_IF_ERROR(sync->SumAccumulated());
    EXPECT_TRUE(AllGradientsAre(*model, 3));
    // A call on top: its own 1 + 2, plus the 3 already summed (once).
    TALLY_ASSIGN_OR_RETURN(auto call, sync->BeginCall(/*overlap=*/false));
    EXPECT_TRUE(call->overlapped_groups().empty());
    FillGradients(*model, env.rank + 1);
    TALLY_RETURN_IF_ERROR(call->Finish());
    EXPECT_TRUE(AllGradientsAre(*model, 6));
    return absl::OkStatus();
  });
}

// dp_shard = 2 and nothing else: the shards' gradients are reduce-scattered
// in backward at stages 2 and 3; only stage 1 keeps whole gradients that
// must be reduced before a step. There are no replicas.
TEST(GradientSyncTest, OnlyZeroStageOneReducesOverDpShard) {
  MeshShape shape;
  shape.dp_shard = 2;
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine, RankEngine(shape, env));
    for (ZeroStage stage : {ZeroStage::kOptimizerState, ZeroStage::kGradients,
                            ZeroStage::kParameters}) {
      const std::string id = absl::StrCat("zero", static_cast<int>(stage));
      SCOPED_TRACE(id);
      EngineTestPeer::SetZeroStage(*engine, stage);
      TALLY_ASSIGN_OR_RETURN(
          GradientSync * sync,
          Build(*engine,
                testing::TinySpec(id, DType::kFloat64, OptimizerKind::kAdamW)));
      const bool stage1 = stage == ZeroStage::kOptimizerState;
      EXPECT_EQ(sync->reduces_whole_gradients(), stage1);
      EXPECT_EQ(sync->needed(), stage1);
      EXPECT_TRUE(sync->replica_sets().empty());
      EXPECT_EQ(sync->tied_embedding(), nullptr);
    }
    return absl::OkStatus();
  });
}

// pp = 2: each stage holds its own parameters, except that a tied
// embedding has a copy on both ends whose gradients must add up.
TEST(GradientSyncTest, PipelineSumsATiedEmbeddingOnly) {
  MeshShape shape;
  shape.pp = 2;
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine, RankEngine(shape, env));
    ModelSpec untied =
        testing::TinySpec("untied", DType::kFloat64, OptimizerKind::kAdamW);
    TALLY_ASSIGN_OR_RETURN(GradientSync * plain, Build(*engine, untied));
    EXPECT_FALSE(plain->needed());

    ModelSpec tied = untied;
    tied.model_id = "tied";
    tied.config = testing::TinyConfig(/*tie_word_embeddings=*/true);
    TALLY_ASSIGN_OR_RETURN(GradientSync * sync, Build(*engine, tied));
    EXPECT_TRUE(sync->needed());
    EXPECT_TRUE(sync->replica_sets().empty());
    const Parameter* copy = sync->tied_embedding();
    EXPECT_NE(copy, nullptr);
    if (copy == nullptr) return absl::OkStatus();
    EXPECT_EQ(copy->name, "model.embed_tokens.weight");
    // Stage s holds s + 1: both copies get 1 + 2.
    TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                           EngineTestPeer::Model(*engine, "tied"));
    FillGradients(*model, env.rank + 1);
    TALLY_RETURN_IF_ERROR(sync->SumAccumulated());
    const torch::Tensor& g = model->Find(copy->name)->tensor.grad();
    EXPECT_TRUE(g.eq(3).all().item<bool>());
    return absl::OkStatus();
  });
}

// A mixture of experts on dp_replicate = 2: dense and expert parameters
// each sum over their own replicas (the experts' are the expert-data-
// parallel ranks), in two sets that split the trainable parameters.
TEST(GradientSyncTest, ExpertsSumOverTheirOwnReplicas) {
  MeshShape shape;
  shape.dp_replicate = 2;
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine, RankEngine(shape, env));
    ModelSpec spec =
        testing::TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW);
    spec.config = testing::MoeConfig();
    TALLY_ASSIGN_OR_RETURN(GradientSync * sync, Build(*engine, spec));
    TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                           EngineTestPeer::Model(*engine, "m"));
    EXPECT_EQ(sync->replica_sets().size(), 2u);
    if (sync->replica_sets().size() != 2) return absl::OkStatus();
    const GradientSet& dense = sync->replica_sets()[0];
    const GradientSet& expert = sync->replica_sets()[1];
    EXPECT_EQ(dense.group, engine->groups().replicas);
    EXPECT_EQ(expert.group, engine->groups().expert_replicas);
    std::vector<Parameter> experts;
    for (const Parameter& p : model->parameters()) {
      if (p.is_expert) experts.push_back(p);
    }
    EXPECT_FALSE(experts.empty());
    EXPECT_EQ(Names(expert.parameters, false), Names(experts, false));
    std::set<std::string> both = Names(dense.parameters, false);
    for (const std::string& name : Names(expert.parameters, false)) {
      EXPECT_TRUE(both.insert(name).second) << name << " in both sets";
    }
    EXPECT_EQ(both, Names(model->parameters(), /*trainable_only=*/true));
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace tally
