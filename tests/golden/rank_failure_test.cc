// A failure seen by one rank only fails the command on every rank with that
// rank's status, and the ranks go on to the next command (the fault hook,
// runtime/parallel/fault_hook.h, makes one rank fail at chosen points); a rank
// whose collective failed answers at once instead of waiting out another
// timeout. Real rank processes on loopback (tests/testing/multirank.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/fault_hook.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

constexpr int kFailingRank = 1;
// Short enough that a rank left waiting (the defect) fails the test quickly.
constexpr absl::Duration kCollectiveTimeout = absl::Seconds(10);

absl::StatusOr<std::unique_ptr<Engine>> RankEngine(
    const MeshShape& shape, const RankEnv& env, const EngineOptions& options,
    absl::Duration collective_timeout = kCollectiveTimeout) {
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
  TALLY_ASSIGN_OR_RETURN(
      auto groups,
      ProcessGroups::Create(env, mesh, absl::Seconds(60), collective_timeout));
  return Engine::Create(options, mesh, std::move(groups));
}

// Fails the `nth` (1-based) visit of `point` on kFailingRank until Disarm.
class InjectedFailure {
 public:
  InjectedFailure(int rank, FaultPoint point, int nth = 1) {
    auto visits = std::make_shared<std::atomic<int>>(0);
    SetFaultHook([=](FaultPoint at) {
      if (rank != kFailingRank || at != point || ++*visits != nth) {
        return absl::OkStatus();
      }
      return absl::ResourceExhaustedError("injected fault");
    });
  }
  ~InjectedFailure() { SetFaultHook(nullptr); }
};

// The status every rank got from one command: the same code everywhere;
// the failing rank's own message, which the others quote naming it.
void ExpectFailedAlike(Communicator& world, const absl::Status& status,
                       absl::StatusCode code) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("injected fault"));
  if (world.rank() != kFailingRank) {
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat("rank ", kFailingRank, " failed")));
  }
  // And the same code on every rank, by the ranks' own account.
  torch::Tensor codes = torch::tensor(
      {static_cast<double>(status.code()), -static_cast<double>(status.code())},
      torch::kFloat64);
  ASSERT_TRUE(world.AllReduce(codes, ReduceOp::kMax).ok());
  EXPECT_EQ(codes[0].item<double>(), -codes[1].item<double>());
}

TEST(AgreeOnStatusTest, TheLowestFailingRanksStatusReachesEveryRank) {
  testing::RunOnRanks(3, [](const RankEnv& env) -> absl::Status {
    MeshShape shape;
    shape.dp_replicate = 3;
    TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
    TALLY_ASSIGN_OR_RETURN(auto groups,
                           ProcessGroups::Create(env, mesh, absl::Seconds(60),
                                                 kCollectiveTimeout));
    Communicator& world = groups->world();
    EXPECT_TRUE(AgreeOnStatus(world, absl::OkStatus(), "x").ok());
    EXPECT_EQ(world.stats().TotalCalls(), 1);

    absl::Status local = absl::OkStatus();
    if (env.rank == 1) local = absl::NotFoundError("no such file");
    if (env.rank == 2) local = absl::DataLossError("corrupt");
    const absl::Status agreed = AgreeOnStatus(world, local, "to load");
    if (env.rank == 0) {
      EXPECT_EQ(agreed.code(), absl::StatusCode::kNotFound);
      EXPECT_EQ(agreed.message(), "rank 1 failed to load: no such file");
    } else {
      EXPECT_EQ(agreed, local);  // its own
    }
    return absl::OkStatus();
  });
}

// Rank 1 never joins rank 0's all-reduce over the replicas, which times out:
// rank 0 then answers a command at once instead of waiting out another
// timeout to agree with its peers, and the failed group fails fast too.
TEST(RankFailureTest, ARankWhoseCollectiveFailedDoesNotWaitToAgree) {
  testing::RunOnRanks(2, [](const RankEnv& env) -> absl::Status {
    MeshShape shape;
    shape.dp_replicate = 2;
    // Half of it bounds a tiny CreateModel on a loaded machine.
    constexpr absl::Duration kTimeout = absl::Seconds(6);
    TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
    TALLY_ASSIGN_OR_RETURN(
        auto groups,
        ProcessGroups::Create(env, mesh, absl::Seconds(60), kTimeout));
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           Engine::Create({}, mesh, std::move(groups)));
    // Rank 1 waits here (the control group of ranks > 0 has no timeout)
    // until rank 0 is done: alive, but in none of rank 0's collectives.
    torch::Tensor done = torch::zeros({1});
    if (env.rank == 1) return engine->control().Recv(done, 0);

    Communicator& replicas = *engine->groups().replicas;
    torch::Tensor sum = torch::ones({1});
    EXPECT_FALSE(replicas.AllReduce(sum, ReduceOp::kSum).ok());
    EXPECT_FALSE(engine->CollectiveFailure().ok());
    const absl::Time start = absl::Now();
    // Building succeeds here; the agreement that follows is skipped.
    EXPECT_FALSE(engine
                     ->CreateModel(testing::TinySpec("m", DType::kFloat64,
                                                     OptimizerKind::kAdamW))
                     .ok());
    EXPECT_FALSE(replicas.AllReduce(sum, ReduceOp::kSum).ok());
    EXPECT_LT(absl::Now() - start, kTimeout / 2);
    return engine->control().Send(done, 1);
  });
}

// Samples of one micro-batch each (max_batch_tokens 16): several
// micro-batches per call on every rank.
std::vector<Sample> Call(uint64_t seed) {
  return testing::MakeSamples(testing::TinyConfig().vocab_size,
                              {9, 4, 12, 7, 10, 5, 11, 8}, seed);
}

EngineOptions FewTokensPerMicroBatch() {
  EngineOptions options;
  options.max_batch_tokens = 16;
  return options;
}

struct ScheduleCase {
  const char* name;
  MeshShape shape;
  FaultPoint point;
  int nth;  // which visit of the point fails; 0: the last micro-batch's
  bool forward_only = false;
};

void PrintTo(const ScheduleCase& c, std::ostream* os) { *os << c.name; }

class ScheduleFailureTest : public ::testing::TestWithParam<ScheduleCase> {};

// A forward or backward that fails on one rank partway through the schedule
// (neighbours waiting for its activations or gradients, replicas for its
// gradient sums) fails the call on every rank with its status; every window
// is poisoned (unless the call was forward-only), and after
// AbortAccumulation the ranks train on.
TEST_P(ScheduleFailureTest, FailsEveryRankAndTheNextCallWorks) {
  const ScheduleCase& c = GetParam();
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           RankEngine(c.shape, env, FewTokensPerMicroBatch()));
    const ModelSpec spec =
        testing::TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW);
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    ForwardBackwardArgs eval{Call(1)};
    eval.forward_only = true;
    TALLY_ASSIGN_OR_RETURN(const ForwardBackwardResult planned,
                           engine->ForwardBackward("m", eval));
    const int micro_batches =
        static_cast<int>(planned.metrics.at("micro_batches"));
    EXPECT_GE(micro_batches, 3);
    {
      InjectedFailure failure(env.rank, c.point,
                              c.nth > 0 ? c.nth : micro_batches);
      ForwardBackwardArgs args{Call(1)};
      args.forward_only = c.forward_only;
      const absl::Status failed = engine->ForwardBackward("m", args).status();
      ExpectFailedAlike(engine->world(), failed, absl::StatusCode::kInternal);
    }
    EXPECT_TRUE(engine->CollectiveFailure().ok());
    TALLY_ASSIGN_OR_RETURN(const bool poisoned, engine->WindowPoisoned("m"));
    EXPECT_EQ(poisoned, !c.forward_only);  // an evaluation adds nothing
    TALLY_RETURN_IF_ERROR(engine->AbortAccumulation("m").status());
    TALLY_RETURN_IF_ERROR(engine->ForwardBackward("m", {Call(2)}).status());
    TALLY_ASSIGN_OR_RETURN(const OptimStepResult step,
                           engine->OptimStep("m", {}));
    EXPECT_EQ(step.step, 1);
    return absl::OkStatus();
  });
}

// A mesh of two ranks along one dimension.
MeshShape TwoAlong(int MeshShape::*dim) {
  MeshShape shape;
  shape.*dim = 2;
  return shape;
}

INSTANTIATE_TEST_SUITE_P(
    OneRank, ScheduleFailureTest,
    ::testing::Values(
        // The last stage fails: the first waits for its gradients.
        ScheduleCase{"Pp2SecondForward", TwoAlong(&MeshShape::pp),
                     FaultPoint::kForward, 2},
        ScheduleCase{"Pp2FirstBackward", TwoAlong(&MeshShape::pp),
                     FaultPoint::kBackward, 1},
        ScheduleCase{"Pp2LastBackward", TwoAlong(&MeshShape::pp),
                     FaultPoint::kBackward, 0},
        ScheduleCase{"Pp2ForwardOnly", TwoAlong(&MeshShape::pp),
                     FaultPoint::kForward, 2,
                     /*forward_only=*/true},
        // A replica fails before / during the backward that starts the
        // gradient sums.
        ScheduleCase{"DpFirstForward", TwoAlong(&MeshShape::dp_replicate),
                     FaultPoint::kForward, 1},
        ScheduleCase{"DpLastBackward", TwoAlong(&MeshShape::dp_replicate),
                     FaultPoint::kBackward, 0}),
    [](const ::testing::TestParamInfo<ScheduleCase>& info) {
      return std::string(info.param.name);
    });

// CreateModel, OptimStep, SaveCheckpoint, ExportWeights and LoadCheckpoint
// failing on one rank (ZeRO-3 over dp_shard = 2, so every command has
// collectives) fail on every rank with its status; each leaves the state its
// documentation says, and the next command works.
TEST(RankFailureTest, EveryCommandFailingOnOneRankFailsOnEveryRank) {
  testing::RunOnRanks(2, [](const RankEnv& env) -> absl::Status {
    MeshShape shape;
    shape.dp_shard = 2;
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           RankEngine(shape, env, FewTokensPerMicroBatch()));
    Communicator& world = engine->world();
    const std::string dir =
        absl::StrCat(::testing::TempDir(), "tally_rankfail_", env.master_port);
    const ModelSpec spec =
        testing::TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW);
    {
      InjectedFailure failure(env.rank, FaultPoint::kBuildModel);
      ExpectFailedAlike(world, engine->CreateModel(spec).status(),
                        absl::StatusCode::kResourceExhausted);
      EXPECT_EQ(engine->num_models(), 0u);
    }
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    TALLY_RETURN_IF_ERROR(engine->ForwardBackward("m", {Call(1)}).status());
    TALLY_RETURN_IF_ERROR(engine->OptimStep("m", {}).status());
    TALLY_RETURN_IF_ERROR(engine->SaveCheckpoint("m", dir + "/a").status());

    for (const char* write : {"save", "export"}) {
      SCOPED_TRACE(write);
      const std::string path = absl::StrCat(dir, "/", write);
      auto run = [&]() -> absl::Status {
        if (std::string(write) == "save") {
          return engine->SaveCheckpoint("m", path).status();
        }
        return engine->ExportWeights("m", path).status();
      };
      {
        InjectedFailure failure(env.rank, FaultPoint::kWrite);
        ExpectFailedAlike(world, run(), absl::StatusCode::kResourceExhausted);
      }
      TALLY_RETURN_IF_ERROR(run());
    }

    TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                           EngineTestPeer::Model(*engine, "m"));
    const std::vector<torch::Tensor> trained = testing::ParameterValues(*model);
    TALLY_RETURN_IF_ERROR(engine->ForwardBackward("m", {Call(2)}).status());
    {
      // A failed update: the model is damaged on every rank (some rank may
      // have updated) until a load.
      InjectedFailure failure(env.rank, FaultPoint::kOptimizerUpdate);
      ExpectFailedAlike(world, engine->OptimStep("m", {}).status(),
                        absl::StatusCode::kResourceExhausted);
    }
    TALLY_ASSIGN_OR_RETURN(ModelSummary summary, engine->GetModel("m"));
    EXPECT_THAT(summary.damage, HasSubstr("injected fault"));
    {
      // A failed load changes nothing: still damaged.
      InjectedFailure failure(env.rank, FaultPoint::kLoad);
      ExpectFailedAlike(world,
                        engine->LoadCheckpoint("m", dir + "/a", true).status(),
                        absl::StatusCode::kResourceExhausted);
    }
    TALLY_ASSIGN_OR_RETURN(summary, engine->GetModel("m"));
    EXPECT_FALSE(summary.damage.empty());
    TALLY_RETURN_IF_ERROR(
        engine->LoadCheckpoint("m", dir + "/a", true).status());
    EXPECT_TRUE(testing::AllEqual(testing::ParameterValues(*model), trained));
    TALLY_RETURN_IF_ERROR(engine->ForwardBackward("m", {Call(2)}).status());
    TALLY_ASSIGN_OR_RETURN(const OptimStepResult step,
                           engine->OptimStep("m", {}));
    EXPECT_EQ(step.step, 2);
    EXPECT_TRUE(engine->CollectiveFailure().ok());
    return absl::OkStatus();
  });
}

// A rank that fails between two collectives of one stage's compute, or of
// the norm or the gather before a write, leaves its peers waiting in the next
// one: it closes its groups (ProcessGroups::FailFast), so the call fails on
// every rank long before a collective would time out; the ranks re-form
// their groups, and the next calls give the bits of a run that never saw
// the failed call.
constexpr absl::Duration kLongTimeout = absl::Seconds(60);

struct RecoveryCase {
  const char* name;
  MeshShape shape;
  FaultPoint point;
  int nth;  // which visit of the point fails; 0: the last micro-batch's
  bool moe = false;
  ZeroStage zero = ZeroStage::kParameters;
  GradSync sync = GradSync::kEager;
};

void PrintTo(const RecoveryCase& c, std::ostream* os) { *os << c.name; }

// Two models of one spec on one engine: "m" sees the failed call, "clean"
// does not.
absl::StatusOr<std::unique_ptr<Engine>> EngineWithTwinModels(
    const RecoveryCase& c, const RankEnv& env) {
  EngineOptions options = FewTokensPerMicroBatch();
  options.zero_stage = c.zero;
  TALLY_ASSIGN_OR_RETURN(auto engine,
                         RankEngine(c.shape, env, options, kLongTimeout));
  for (const char* id : {"m", "clean"}) {
    ModelSpec spec =
        testing::TinySpec(id, DType::kFloat64, OptimizerKind::kAdamW);
    spec.grad_sync = c.sync;
    if (c.moe) spec.config = testing::MoeConfig(spec.config);
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
  }
  return engine;
}

// Runs `command` with the fault armed: it fails alike on every rank within
// a third of the collective timeout, and leaves the groups working.
void ExpectFailsFastAlike(Engine& engine, const RecoveryCase& c,
                          const RankEnv& env, absl::StatusCode code,
                          const std::function<absl::Status()>& command) {
  absl::Status failed;
  const absl::Time start = absl::Now();
  {
    InjectedFailure failure(env.rank, c.point, c.nth);
    failed = command();
  }
  EXPECT_LT(absl::Now() - start, kLongTimeout / 3);
  EXPECT_TRUE(engine.CollectiveFailure().ok()) << engine.CollectiveFailure();
  // On the re-formed groups.
  ExpectFailedAlike(engine.world(), failed, code);
}

// One training step of `id` on Call(2), then the loss of Call(3).
absl::StatusOr<double> StepAndEvaluate(Engine& engine, const std::string& id) {
  TALLY_RETURN_IF_ERROR(engine.ForwardBackward(id, {Call(2)}).status());
  TALLY_RETURN_IF_ERROR(engine.OptimStep(id, {}).status());
  ForwardBackwardArgs eval{Call(3)};
  eval.forward_only = true;
  TALLY_ASSIGN_OR_RETURN(const ForwardBackwardResult result,
                         engine.ForwardBackward(id, eval));
  return result.loss_sum;
}

class InPassFailureTest : public ::testing::TestWithParam<RecoveryCase> {};

// How many micro-batches a call of `samples` runs on each rank.
absl::StatusOr<int> MicroBatches(Engine& engine, std::vector<Sample> samples) {
  ForwardBackwardArgs eval{std::move(samples)};
  eval.forward_only = true;
  TALLY_ASSIGN_OR_RETURN(const ForwardBackwardResult planned,
                         engine.ForwardBackward("m", eval));
  return static_cast<int>(planned.metrics.at("micro_batches"));
}

TEST_P(InPassFailureTest, FailsFastOnEveryRankAndTheNextCallsAreExact) {
  RecoveryCase c = GetParam();
  const int ranks = c.shape.world_size();
  testing::RunOnRanks(ranks, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine, EngineWithTwinModels(c, env));
    if (c.nth == 0) {
      TALLY_ASSIGN_OR_RETURN(c.nth, MicroBatches(*engine, Call(1)));
      EXPECT_GE(c.nth, 2);
    }
    ExpectFailsFastAlike(*engine, c, env, absl::StatusCode::kInternal, [&] {
      return engine->ForwardBackward("m", {Call(1)}).status();
    });
    TALLY_ASSIGN_OR_RETURN(const bool poisoned, engine->WindowPoisoned("m"));
    EXPECT_TRUE(poisoned);
    TALLY_RETURN_IF_ERROR(engine->AbortAccumulation("m").status());
    TALLY_ASSIGN_OR_RETURN(const double loss, StepAndEvaluate(*engine, "m"));
    TALLY_ASSIGN_OR_RETURN(const double clean_loss,
                           StepAndEvaluate(*engine, "clean"));
    EXPECT_EQ(loss, clean_loss);
    TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                           EngineTestPeer::Model(*engine, "m"));
    TALLY_ASSIGN_OR_RETURN(CausalLm * clean,
                           EngineTestPeer::Model(*engine, "clean"));
    EXPECT_TRUE(testing::AllEqual(testing::ParameterValues(*model),
                                  testing::ParameterValues(*clean)));
    return absl::OkStatus();
  });
}

// ZeRO-3 (the default stage): each layer's parameters are gathered in the
// forward and their gradients reduce-scattered in the backward.
MeshShape Zero3Mesh() { return TwoAlong(&MeshShape::dp_shard); }

MeshShape DpShard2Ep2() {
  MeshShape shape = Zero3Mesh();
  shape.ep = 2;
  return shape;
}

// Four ranks: the layers communicate over tp, and the replicas' gradient
// sums overlap the last backward.
MeshShape Tp2Dp2() {
  MeshShape shape = TwoAlong(&MeshShape::tp);
  shape.dp_replicate = 2;
  return shape;
}

INSTANTIATE_TEST_SUITE_P(
    OneRank, InPassFailureTest,
    ::testing::Values(
        // The peer waits in the second micro-batch's first collective, or
        // in the first backward's.
        RecoveryCase{"Tp2SecondForward", TwoAlong(&MeshShape::tp),
                     FaultPoint::kForward, 2},
        RecoveryCase{"Tp2FirstBackward", TwoAlong(&MeshShape::tp),
                     FaultPoint::kBackward, 1},
        RecoveryCase{"Cp2SecondForward", TwoAlong(&MeshShape::cp),
                     FaultPoint::kForward, 2},
        RecoveryCase{"Zero3SecondForward", Zero3Mesh(), FaultPoint::kForward,
                     2},
        RecoveryCase{"Zero3FirstBackward", Zero3Mesh(), FaultPoint::kBackward,
                     1},
        RecoveryCase{"Ep2MoeSecondForward", DpShard2Ep2(), FaultPoint::kForward,
                     2, /*moe=*/true},
        // The failing rank's tp peer and replica have gradient sums in
        // flight (started by the last backward's hooks) when its groups
        // close.
        RecoveryCase{"Tp2Dp2LastBackward", Tp2Dp2(), FaultPoint::kBackward, 0},
        RecoveryCase{"Dp2LastBackward", TwoAlong(&MeshShape::dp_replicate),
                     FaultPoint::kBackward, 0}),
    [](const ::testing::TestParamInfo<RecoveryCase>& info) {
      return std::string(info.param.name);
    });

// A rank that fails computing its part of the gradient norm: the others
// wait in the norm's all-reduce. Nothing was written, so the window stays
// and the retried OptimStep steps exactly like a clean one.
TEST(RankFailureTest, AFailureInTheNormFailsFastAndTheRetryIsExact) {
  const RecoveryCase c{"Zero3Norm", Zero3Mesh(), FaultPoint::kGradNorm, 1};
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine, EngineWithTwinModels(c, env));
    for (const char* id : {"m", "clean"}) {
      TALLY_RETURN_IF_ERROR(engine->ForwardBackward(id, {Call(1)}).status());
    }
    ExpectFailsFastAlike(*engine, c, env, absl::StatusCode::kResourceExhausted,
                         [&] { return engine->OptimStep("m", {}).status(); });
    TALLY_ASSIGN_OR_RETURN(const ModelSummary summary, engine->GetModel("m"));
    EXPECT_TRUE(summary.damage.empty()) << summary.damage;
    for (const char* id : {"m", "clean"}) {
      TALLY_ASSIGN_OR_RETURN(const OptimStepResult step,
                             engine->OptimStep(id, {}));
      EXPECT_EQ(step.step, 1);
    }
    TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                           EngineTestPeer::Model(*engine, "m"));
    TALLY_ASSIGN_OR_RETURN(CausalLm * clean,
                           EngineTestPeer::Model(*engine, "clean"));
    EXPECT_TRUE(testing::AllEqual(testing::ParameterValues(*model),
                                  testing::ParameterValues(*clean)));
    return absl::OkStatus();
  });
}

// A rank that fails partway through gathering a sharded model for the
// writer (after its first tensor): the others wait in the next gather. The
// write fails fast everywhere, the model is untouched, and the next write
// works.
TEST(RankFailureTest, AFailurePartwayThroughTheGatherFailsFast) {
  const RecoveryCase c{"Zero3Gather", Zero3Mesh(), FaultPoint::kGather, 2};
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine, EngineWithTwinModels(c, env));
    TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                           EngineTestPeer::Model(*engine, "m"));
    const std::vector<torch::Tensor> before = testing::ParameterValues(*model);
    const std::string dir = absl::StrCat(::testing::TempDir(),
                                         "tally_gatherfail_", env.master_port);
    for (const char* write : {"save", "export"}) {
      SCOPED_TRACE(write);
      const std::string path = absl::StrCat(dir, "/", write);
      auto run = [&]() -> absl::Status {
        if (std::string(write) == "save") {
          return engine->SaveCheckpoint("m", path).status();
        }
        return engine->ExportWeights("m", path).status();
      };
      ExpectFailsFastAlike(*engine, c, env,
                           absl::StatusCode::kResourceExhausted, run);
      TALLY_RETURN_IF_ERROR(run());
    }
    EXPECT_TRUE(testing::AllEqual(testing::ParameterValues(*model), before));
    TALLY_RETURN_IF_ERROR(
        engine->LoadCheckpoint("m", dir + "/save", true).status());
    EXPECT_TRUE(testing::AllEqual(testing::ParameterValues(*model), before));
    return absl::OkStatus();
  });
}

// A rank that fails partway through a phase of collectives outside the
// passes (ZeRO-1's gradient sum, the gathers of the kept copies after a
// create, a step or a load) or between the copies of a load fails the
// command on every rank alike within a third of the timeout (at the
// command's phase boundary, FinishPhase in runtime/parallel/phase_boundary.h),
// with the state its documentation says, and the ranks go on: after the window
// is aborted or the model reloaded, the next step equals the twin's that never
// failed.
enum class Command {
  kCreateModel,      // leaves no model on any rank
  kForwardBackward,  // poisons the window
  kOptimStepSum,     // DEFERRED: poisons the window
  kOptimStepUpdate,  // damages the model
  kLoadCheckpoint,   // damages the model
};

struct CommandCase {
  RecoveryCase recovery;
  Command command;
  absl::StatusCode code = absl::StatusCode::kResourceExhausted;
};

void PrintTo(const CommandCase& c, std::ostream* os) { *os << c.recovery.name; }

class CommandFailureTest : public ::testing::TestWithParam<CommandCase> {};

TEST_P(CommandFailureTest, FailsFastOnEveryRankAndTheNextStepIsExact) {
  const CommandCase& c = GetParam();
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine, EngineWithTwinModels(c.recovery, env));
    const std::string before = absl::StrCat(
        ::testing::TempDir(), "tally_commandfail_", env.master_port, "/m");
    TALLY_RETURN_IF_ERROR(engine->SaveCheckpoint("m", before).status());
    if (c.command == Command::kOptimStepSum ||
        c.command == Command::kOptimStepUpdate) {
      for (const char* id : {"m", "clean"}) {
        TALLY_RETURN_IF_ERROR(engine->ForwardBackward(id, {Call(1)}).status());
      }
    }
    const ModelSpec other =
        testing::TinySpec("other", DType::kFloat64, OptimizerKind::kAdamW);
    ExpectFailsFastAlike(*engine, c.recovery, env, c.code, [&] {
      switch (c.command) {
        case Command::kCreateModel:
          return engine->CreateModel(other).status();
        case Command::kForwardBackward:
          return engine->ForwardBackward("m", {Call(1)}).status();
        case Command::kOptimStepSum:
        case Command::kOptimStepUpdate:
          return engine->OptimStep("m", {}).status();
        case Command::kLoadCheckpoint:
          return engine->LoadCheckpoint("m", before, true).status();
      }
      return absl::InternalError("unknown command");
    });
    TALLY_ASSIGN_OR_RETURN(const ModelSummary summary, engine->GetModel("m"));
    TALLY_ASSIGN_OR_RETURN(const bool poisoned, engine->WindowPoisoned("m"));
    switch (c.command) {
      case Command::kCreateModel:
        EXPECT_EQ(engine->num_models(), 2u);
        EXPECT_EQ(engine->GetModel("other").status().code(),
                  absl::StatusCode::kNotFound);
        TALLY_RETURN_IF_ERROR(engine->CreateModel(other).status());
        break;
      case Command::kForwardBackward:
      case Command::kOptimStepSum:
        EXPECT_TRUE(poisoned);
        EXPECT_TRUE(summary.damage.empty()) << summary.damage;
        TALLY_RETURN_IF_ERROR(engine->AbortAccumulation("m").status());
        break;
      case Command::kOptimStepUpdate:
      case Command::kLoadCheckpoint:
        EXPECT_THAT(summary.damage, HasSubstr("injected fault"));
        TALLY_RETURN_IF_ERROR(
            engine->LoadCheckpoint("m", before, true).status());
        break;
    }
    TALLY_RETURN_IF_ERROR(engine->AbortAccumulation("clean").status());
    TALLY_ASSIGN_OR_RETURN(const double loss, StepAndEvaluate(*engine, "m"));
    TALLY_ASSIGN_OR_RETURN(const double clean_loss,
                           StepAndEvaluate(*engine, "clean"));
    EXPECT_EQ(loss, clean_loss);
    TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                           EngineTestPeer::Model(*engine, "m"));
    TALLY_ASSIGN_OR_RETURN(CausalLm * clean,
                           EngineTestPeer::Model(*engine, "clean"));
    EXPECT_TRUE(testing::AllEqual(testing::ParameterValues(*model),
                                  testing::ParameterValues(*clean)));
    return absl::OkStatus();
  });
}

// ZeRO-1 over dp_shard = 2: whole gradients reduce-scattered one parameter
// at a time, the parameters' kept copies gathered one at a time.
RecoveryCase Zero1(const char* name, FaultPoint point,
                   GradSync sync = GradSync::kEager) {
  RecoveryCase c{name, Zero3Mesh(), point, 2};
  c.zero = ZeroStage::kOptimizerState;
  c.sync = sync;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    OneRank, CommandFailureTest,
    ::testing::Values(
        CommandCase{
            Zero1("Zero1CreateModelGather", FaultPoint::kRefreshGathered),
            Command::kCreateModel},
        CommandCase{Zero1("Zero1EagerGradientSum", FaultPoint::kGradientSync),
                    Command::kForwardBackward},
        CommandCase{Zero1("Zero1DeferredGradientSum", FaultPoint::kGradientSync,
                          GradSync::kDeferred),
                    Command::kOptimStepSum},
        CommandCase{Zero1("Zero1UpdateGather", FaultPoint::kRefreshGathered),
                    Command::kOptimStepUpdate},
        CommandCase{Zero1("Zero1LoadGather", FaultPoint::kRefreshGathered),
                    Command::kLoadCheckpoint},
        // ZeRO-3 keeps no copies: the load has no collective after its
        // agreement on what was read, so a copy failing on one rank used to
        // leave the ranks disagreeing.
        CommandCase{{"Zero3LoadCopy", Zero3Mesh(), FaultPoint::kLoadCopy, 2},
                    Command::kLoadCheckpoint,
                    absl::StatusCode::kInternal}),
    [](const ::testing::TestParamInfo<CommandCase>& info) {
      return std::string(info.param.recovery.name);
    });

}  // namespace
}  // namespace tally
