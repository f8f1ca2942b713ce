// ZeRO stages 1 and 2 (runtime/parallel/zero.h) on real dp_shard = 2 rank
// processes: the collectives a window issues over dp_shard and the state each
// rank holds follow the stage's definition (seed-data-parallelism-zero),
// counted from the Communicator and computed here from the parameters' shapes;
// a LoRA base is gathered once for all its adapters' steps. Exactness against
// the single device is the golden tests' (ZeroStageGoldenTest).
#include "runtime/parallel/zero.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/config/memory_estimate.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/parallel_ops.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/golden.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::MakeSamples;
using testing::RelativeDiff;
using testing::TinySpec;

constexpr int kShards = 2;
constexpr int kCalls = 3;

MeshShape DpShard2() {
  MeshShape shape;
  shape.dp_shard = kShards;
  return shape;
}

// This rank's engine on dp_shard = 2 at ZeRO `stage`.
absl::StatusOr<std::unique_ptr<Engine>> StageEngine(const RankEnv& env,
                                                    ZeroStage stage) {
  EngineOptions options;
  options.zero_stage = stage;
  return testing::CreateRankEngine(DpShard2(), env, options);
}

// A checkpoint directory of this launch of rank processes.
std::string CheckpointDir(const RankEnv& env, const char* name) {
  return absl::StrCat(::testing::TempDir(), "tally_zero_", name, "_",
                      env.master_port);
}

std::vector<std::vector<Sample>> Calls() {
  const int64_t vocab = testing::TinyConfig().vocab_size;
  std::vector<std::vector<Sample>> calls;
  for (int c = 0; c < kCalls; ++c) {
    calls.push_back(MakeSamples(vocab, {9, 4, 12, 7}, 50 + c));
  }
  return calls;
}

std::string StageName(ZeroStage stage) {
  return absl::StrCat("zero", static_cast<int>(stage));
}

// What the window's dp_shard collectives should be, from the shapes alone:
// a reduce-scatter contributes the whole (padded) tp-local tensor, an
// all-gather this rank's shard.
struct Expected {
  int64_t all_gathers = 0, all_gather_bytes = 0;
  int64_t reduce_scatters = 0, reduce_scatter_bytes = 0;
};

// The kCalls calls of a window and its OptimStep on model `id`; returns the
// forward/backward passes (micro-batches) the window ran.
absl::StatusOr<int64_t> RunWindow(Engine& engine, const std::string& id) {
  int64_t passes = 0;
  for (const std::vector<Sample>& call : Calls()) {
    TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult fb,
                           engine.ForwardBackward(id, {call}));
    passes += static_cast<int64_t>(fb.metrics.at("micro_batches"));
  }
  TALLY_RETURN_IF_ERROR(engine.OptimStep(id, {}).status());
  return passes;
}

// Per trainable parameter: one collective of each kind per `*_per_param`
// occurrence.
Expected ExpectedCollectives(const std::vector<Parameter>& params,
                             int64_t gathers_per_param,
                             int64_t scatters_per_param) {
  Expected e;
  for (const Parameter& p : params) {
    if (!p.trainable) continue;
    const int64_t shard_bytes = static_cast<int64_t>(p.tensor.nbytes());
    e.all_gathers += gathers_per_param;
    e.all_gather_bytes += gathers_per_param * shard_bytes;
    e.reduce_scatters += scatters_per_param;
    e.reduce_scatter_bytes += scatters_per_param * kShards * shard_bytes;
  }
  return e;
}

// Stage 1 reduce-scatters once per sync (EAGER: per call; DEFERRED: at the
// step) and stage 2 once per pass; both all-gather once, after the step.
// Stage 3 all-gathers and reduce-scatters once per pass.
TEST(ZeroStageTest, DpShardCollectivesPerWindowFollowTheStage) {
  testing::RunOnRanks(kShards, [](const RankEnv& env) -> absl::Status {
    EngineOptions options;
    options.max_batch_tokens = 16;  // a sample per pass
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           testing::CreateRankEngine(DpShard2(), env, options));
    Communicator& dp_shard = *engine->groups().dp_shard;
    for (ZeroStage stage : {ZeroStage::kOptimizerState, ZeroStage::kGradients,
                            ZeroStage::kParameters}) {
      for (GradSync sync : {GradSync::kEager, GradSync::kDeferred}) {
        const std::string id = absl::StrCat(
            StageName(stage), sync == GradSync::kEager ? "e" : "d");
        SCOPED_TRACE(id);
        EngineTestPeer::SetZeroStage(*engine, stage);
        ModelSpec spec = TinySpec(id, DType::kFloat64, OptimizerKind::kAdamW);
        spec.grad_sync = sync;
        TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
        dp_shard.stats().Reset();
        TALLY_ASSIGN_OR_RETURN(const int64_t passes, RunWindow(*engine, id));
        EXPECT_GT(passes, kCalls);  // several passes per call
        const std::vector<Parameter>& params =
            EngineTestPeer::Model(*engine, id).value()->parameters();
        Expected want;
        if (stage == ZeroStage::kOptimizerState) {
          want = ExpectedCollectives(params, 1,
                                     sync == GradSync::kEager ? kCalls : 1);
        } else if (stage == ZeroStage::kGradients) {
          want = ExpectedCollectives(params, 1, passes);
        } else {
          want = ExpectedCollectives(params, passes, passes);
        }
        const CommCounter& gathers = dp_shard.stats().Get(CommOp::kAllGather);
        const CommCounter& scatters =
            dp_shard.stats().Get(CommOp::kReduceScatter);
        EXPECT_EQ(gathers.calls, want.all_gathers);
        EXPECT_EQ(gathers.bytes, want.all_gather_bytes);
        EXPECT_EQ(scatters.calls, want.reduce_scatters);
        EXPECT_EQ(scatters.bytes, want.reduce_scatter_bytes);
        TALLY_RETURN_IF_ERROR(engine->DeleteModel(id).status());
      }
    }
    return absl::OkStatus();
  });
}

// The model state an OptimStep reports per rank, against the seed's memory
// table with Ψ the tp-local parameter bytes: stage 3 holds Ψ/S of parameters
// and gradients; stage 2 the gathered parameters Ψ beside the shard Ψ/S (the
// master the optimizer steps); stage 1 also the whole gradient Ψ beside the
// reduced shard Ψ/S. AdamW's moments are 2Ψ/S at every stage. The memory
// estimate admission charges bounds each.
TEST(ZeroStageTest, ModelStatePerRankFollowsTheStage) {
  testing::RunOnRanks(kShards, [](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           testing::CreateRankEngine(DpShard2(), env, {}));
    for (ZeroStage stage : {ZeroStage::kOptimizerState, ZeroStage::kGradients,
                            ZeroStage::kParameters}) {
      SCOPED_TRACE(StageName(stage));
      EngineTestPeer::SetZeroStage(*engine, stage);
      const std::string id = StageName(stage);
      const ModelSpec spec =
          TinySpec(id, DType::kFloat64, OptimizerKind::kAdamW);
      TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
      TALLY_RETURN_IF_ERROR(engine->ForwardBackward(id, {Calls()[0]}).status());
      TALLY_ASSIGN_OR_RETURN(OptimStepResult step, engine->OptimStep(id, {}));
      double whole = 0, shard = 0;
      for (const Parameter& p :
           EngineTestPeer::Model(*engine, id).value()->parameters()) {
        whole += static_cast<double>(p.tensor.numel() / p.tensor.size(0) *
                                     p.tp_local_shape[0] * sizeof(double));
        shard += static_cast<double>(p.tensor.nbytes());
      }
      const double gathered = stage == ZeroStage::kParameters ? 0 : whole;
      const double whole_grads =
          stage == ZeroStage::kOptimizerState ? whole : 0;
      EXPECT_EQ(step.metrics["rank_param_bytes"], gathered + shard);
      EXPECT_EQ(step.metrics["rank_grad_bytes"], whole_grads + shard);
      EXPECT_EQ(step.metrics["rank_optimizer_bytes"], 2 * shard);
      const double total = step.metrics["rank_param_bytes"] +
                           step.metrics["rank_grad_bytes"] +
                           step.metrics["rank_optimizer_bytes"];
      EXPECT_LE(total, ModelResidentBytes(spec.config, spec.dtype,
                                          spec.optimizer, kShards, stage));
      TALLY_RETURN_IF_ERROR(engine->DeleteModel(id).status());
    }
    return absl::OkStatus();
  });
}

LoraConfig TestLora() {
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 4;
  lora.seed = 7;
  return lora;
}

// Under stages 1 and 2 a LoRA base is gathered when it is built, shared by
// its adapters, and never gathered again: an adapter's steps all-gather its
// own factors only, and only the factors keep whole gradients. The adapters
// train as under stage 3.
TEST(ZeroStageTest, LoraBaseIsGatheredOnceForAllItsAdapters) {
  testing::RunOnRanks(kShards, [](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           testing::CreateRankEngine(DpShard2(), env, {}));
    Communicator& dp_shard = *engine->groups().dp_shard;
    std::vector<std::vector<torch::Tensor>> trained;
    for (ZeroStage stage : {ZeroStage::kParameters, ZeroStage::kOptimizerState,
                            ZeroStage::kGradients}) {
      SCOPED_TRACE(StageName(stage));
      EngineTestPeer::SetZeroStage(*engine, stage);
      // The tenant scope keeps each stage's base apart.
      const std::string id = absl::StrCat(StageName(stage), "/adapter");
      ModelSpec spec = TinySpec(id, DType::kFloat64, OptimizerKind::kAdamW);
      spec.lora = TestLora();
      TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
      CausalLm& model = *EngineTestPeer::Model(*engine, id).value();
      EXPECT_EQ(KeepsWholeGradients(model.parameters()),
                stage == ZeroStage::kOptimizerState);
      int64_t factors = 0;
      for (const Parameter& p : model.parameters()) {
        if (p.trainable) ++factors;
        EXPECT_EQ(p.gathered != nullptr, stage != ZeroStage::kParameters);
        if (p.gathered != nullptr) {
          EXPECT_TRUE(p.gathered->value.defined()) << p.name;
        }
      }
      dp_shard.stats().Reset();
      TALLY_RETURN_IF_ERROR(RunWindow(*engine, id).status());
      if (stage != ZeroStage::kParameters) {
        EXPECT_EQ(dp_shard.stats().Get(CommOp::kAllGather).calls, factors);
      }
      for (const Parameter& p : model.parameters()) {
        // Only the factors keep a whole gradient (stage 1), the frozen base
        // none.
        if (p.gathered == nullptr) continue;
        EXPECT_EQ(p.gathered->grad.defined(),
                  p.trainable && stage == ZeroStage::kOptimizerState)
            << p.name;
      }
      trained.push_back(testing::ParameterValues(model));
    }
    for (size_t s = 1; s < trained.size(); ++s) {
      for (size_t i = 0; i < trained[0].size(); ++i) {
        EXPECT_LT(RelativeDiff(trained[s][i], trained[0][i]), 1e-12)
            << "stage index " << s << ", parameter " << i;
      }
    }
    return absl::OkStatus();
  });
}

// ZeRO-1's whole gradients are the window's: an aborted window leaves none
// behind, and the next window equals a fresh model's.
TEST(ZeroStageTest, AbortedWindowLeavesNoWholeGradient) {
  testing::RunOnRanks(kShards, [](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           StageEngine(env, ZeroStage::kOptimizerState));
    for (const char* id : {"aborted", "fresh"}) {
      ModelSpec spec = TinySpec(id, DType::kFloat64, OptimizerKind::kAdamW);
      spec.grad_sync = GradSync::kDeferred;
      TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    }
    TALLY_RETURN_IF_ERROR(
        engine->ForwardBackward("aborted", {Calls()[2]}).status());
    TALLY_RETURN_IF_ERROR(engine->AbortAccumulation("aborted").status());
    for (const Parameter& p :
         EngineTestPeer::Model(*engine, "aborted").value()->parameters()) {
      EXPECT_EQ(p.gathered->grad.abs().max().item<double>(), 0.0) << p.name;
    }
    for (const char* id : {"aborted", "fresh"}) {
      TALLY_RETURN_IF_ERROR(RunWindow(*engine, id).status());
    }
    EXPECT_TRUE(testing::AllEqual(
        testing::ParameterValues(
            *EngineTestPeer::Model(*engine, "aborted").value()),
        testing::ParameterValues(
            *EngineTestPeer::Model(*engine, "fresh").value())));
    return absl::OkStatus();
  });
}

// A LoRA factor frozen by a pattern still takes a checkpoint's values, and
// its gathered copy follows: adapter B (another seed, lora_A frozen) loaded
// with adapter A's checkpoint computes A's losses.
TEST(ZeroStageTest, LoadedFrozenFactorsAreGatheredAgain) {
  testing::RunOnRanks(kShards, [](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           StageEngine(env, ZeroStage::kGradients));
    ModelSpec a = TinySpec("a", DType::kFloat64, OptimizerKind::kAdamW);
    a.lora = TestLora();
    TALLY_RETURN_IF_ERROR(engine->CreateModel(a).status());
    TALLY_RETURN_IF_ERROR(RunWindow(*engine, "a").status());
    const std::string dir = CheckpointDir(env, "a");
    TALLY_RETURN_IF_ERROR(engine->SaveCheckpoint("a", dir).status());
    ModelSpec b = a;
    b.model_id = "b";
    b.lora.seed = 8;
    b.frozen = {"model.layers.*.self_attn.q_proj.lora_A.weight"};
    TALLY_RETURN_IF_ERROR(engine->CreateModel(b).status());
    TALLY_RETURN_IF_ERROR(engine->LoadCheckpoint("b", dir, false).status());
    ForwardBackwardArgs eval{Calls()[1]};
    eval.forward_only = true;
    TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult want,
                           engine->ForwardBackward("a", eval));
    TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult got,
                           engine->ForwardBackward("b", eval));
    EXPECT_EQ(got.loss_sum, want.loss_sum);
    return absl::OkStatus();
  });
}

// A model one rank cannot build (its init_checkpoint is missing there) is
// refused on every rank without leaving the others in a gather, and the
// engine goes on serving.
TEST(ZeroStageTest, ModelOneRankCannotBuildIsRefusedEverywhere) {
  testing::RunOnRanks(kShards, [](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           StageEngine(env, ZeroStage::kOptimizerState));
    ModelSpec spec = TinySpec("saved", DType::kFloat64, OptimizerKind::kAdamW);
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    const std::string dir = CheckpointDir(env, "saved");
    TALLY_RETURN_IF_ERROR(engine->SaveCheckpoint("saved", dir).status());
    spec.model_id = "from_checkpoint";
    spec.init_checkpoint = env.rank == 0 ? dir : dir + "_missing";
    EXPECT_FALSE(engine->CreateModel(spec).ok());
    EXPECT_EQ(engine->num_models(), 1u);
    spec.init_checkpoint = dir;
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    return RunWindow(*engine, "from_checkpoint").status();
  });
}

}  // namespace
}  // namespace tally
