// CreateRankEngine: how a tally-server process becomes a rank, with real
// rank processes on loopback.
#include <gtest/gtest.h>

#include "server/server.h"
#include "tests/testing/multirank.h"

namespace tally {
namespace {

ServerOptions RankOptions(const RankEnv& env) {
  ServerOptions options;
  options.mesh.dp_shard = env.world_size;
  options.rank_env.rank = env.rank;
  options.rank_env.world_size = env.world_size;
  options.rank_env.master_addr = env.master_addr;
  options.rank_env.master_port = env.master_port;
  options.rendezvous_timeout_secs = 60;
  return options;
}

TEST(RankEngineTest, EveryRankGetsTheDemoModel) {
  testing::RunOnRanks(2, [](const RankEnv& env) -> absl::Status {
    ServerOptions options = RankOptions(env);
    options.demo_model = true;
    absl::StatusOr<std::unique_ptr<Engine>> engine = CreateRankEngine(options);
    if (!engine.ok()) return engine.status();
    EXPECT_EQ((*engine)->mesh().rank(), env.rank);
    EXPECT_EQ((*engine)->mesh().size(MeshDim::kDpShard), 2);
    EXPECT_TRUE((*engine)->GetModel(kDemoModelId).ok());
    return absl::OkStatus();
  });
}

TEST(RankEngineTest, SettingsThatDecideCollectivesMustMatch) {
  testing::RunOnRanks(2, [](const RankEnv& env) -> absl::Status {
    ServerOptions options = RankOptions(env);
    // An external launcher gave the ranks different flags.
    options.max_batch_tokens = env.rank == 0 ? 4096 : 8192;
    absl::StatusOr<std::unique_ptr<Engine>> engine = CreateRankEngine(options);
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(engine.status().message().find("--max-batch-tokens"),
              std::string::npos)
        << engine.status();
    return absl::OkStatus();
  });
}

TEST(RankEngineTest, WorldAndMeshMustAgree) {
  ServerOptions options;
  options.mesh.tp = 2;  // needs two ranks; the environment says one
  options.rank_env.world_size = 1;
  options.rank_env.rank = 0;
  auto engine = CreateRankEngine(options);
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("mesh"), std::string::npos);
}

}  // namespace
}  // namespace tally
