// Rank environment resolution, and process groups over real rank processes
// on loopback: rank-encoded values (2^rank) prove which ranks each group
// reduces over, and every collective is checked against values computed here
// from the rank numbers alone.
#include "runtime/parallel/distributed.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "tests/testing/multirank.h"

namespace tally {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using Vars = std::map<std::string, std::string>;

EnvLookup LookupIn(Vars vars) {
  return
      [vars = std::move(vars)](const char* name) -> std::optional<std::string> {
        auto it = vars.find(name);
        if (it == vars.end()) return std::nullopt;
        return it->second;
      };
}

TEST(RankEnvTest, NothingSetIsASingleRank) {
  RankEnv env = ResolveRankEnv({}, LookupIn({})).value();
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.source, "default");
}

TEST(RankEnvTest, TorchrunVariables) {
  RankEnv env = ResolveRankEnv({}, LookupIn({{"RANK", "5"},
                                             {"WORLD_SIZE", "8"},
                                             {"LOCAL_RANK", "1"},
                                             {"MASTER_ADDR", "10.1.2.3"},
                                             {"MASTER_PORT", "23456"},
                                             {"GLOO_SOCKET_IFNAME", "eth1"}}))
                    .value();
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "10.1.2.3");
  EXPECT_EQ(env.master_port, 23456);
  EXPECT_EQ(env.gloo_interface, "eth1");
  EXPECT_EQ(env.source, "torchrun");
}

TEST(RankEnvTest, LeaderWorkerSetVariables) {
  Vars lws = {{"LWS_LEADER_ADDRESS", "tally-0.tally.default"},
              {"LWS_GROUP_SIZE", "4"},
              {"LWS_WORKER_INDEX", "3"}};
  RankEnv env = ResolveRankEnv({}, LookupIn(lws)).value();
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.master_addr, "tally-0.tally.default");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.source, "lws");

  lws["MASTER_PORT"] = "31000";
  EXPECT_EQ(ResolveRankEnv({}, LookupIn(lws)).value().master_port, 31000);
}

TEST(RankEnvTest, TorchrunInsideALeaderWorkerSetPodWins) {
  RankEnv env = ResolveRankEnv({}, LookupIn({{"LWS_LEADER_ADDRESS", "leader"},
                                             {"LWS_GROUP_SIZE", "2"},
                                             {"LWS_WORKER_INDEX", "1"},
                                             {"RANK", "6"},
                                             {"WORLD_SIZE", "8"},
                                             {"MASTER_ADDR", "leader-ip"}}))
                    .value();
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.rank, 6);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.master_addr, "leader-ip");
}

TEST(RankEnvTest, FlagsWinFieldByField) {
  const Vars torchrun = {{"RANK", "1"},
                         {"WORLD_SIZE", "2"},
                         {"LOCAL_RANK", "1"},
                         {"MASTER_ADDR", "10.0.0.1"},
                         {"MASTER_PORT", "1234"}};
  RankEnvOverrides all;
  all.rank = 3;
  all.world_size = 4;
  all.local_rank = 2;
  all.master_addr = "master.example";
  all.master_port = 4321;
  RankEnv env = ResolveRankEnv(all, LookupIn(torchrun)).value();
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.master_addr, "master.example");
  EXPECT_EQ(env.master_port, 4321);
  EXPECT_EQ(env.source, "flags");

  RankEnvOverrides port_only;
  port_only.master_port = 4321;
  env = ResolveRankEnv(port_only, LookupIn(torchrun)).value();
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 4321);
  EXPECT_EQ(env.source, "torchrun");
}

struct MalformedCase {
  std::string label;
  Vars vars;
  RankEnvOverrides overrides;
  std::string named;  // the variable or flag the error must start with
};

RankEnvOverrides RankFlags(int rank, int world_size) {
  RankEnvOverrides overrides;
  overrides.rank = rank;
  overrides.world_size = world_size;
  return overrides;
}

TEST(RankEnvTest, MalformedValuesNameTheVariable) {
  RankEnvOverrides bad_port;
  bad_port.master_port = 0;
  RankEnvOverrides empty_addr;
  empty_addr.master_addr = "";
  const std::vector<MalformedCase> cases = {
      {"rank not a number", {{"RANK", "one"}, {"WORLD_SIZE", "2"}}, {}, "RANK"},
      {"rank trailing junk", {{"RANK", "1x"}, {"WORLD_SIZE", "2"}}, {}, "RANK"},
      {"rank negative", {{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, {}, "RANK"},
      {"rank = world", {{"RANK", "2"}, {"WORLD_SIZE", "2"}}, {}, "RANK"},
      {"world zero", {{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {}, "WORLD_SIZE"},
      {"world not a number",
       {{"RANK", "0"}, {"WORLD_SIZE", "many"}},
       {},
       "WORLD_SIZE"},
      {"rank without world", {{"RANK", "0"}}, {}, "WORLD_SIZE"},
      {"world without rank", {{"WORLD_SIZE", "4"}}, {}, "RANK"},
      {"local rank",
       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "a"}},
       {},
       "LOCAL_RANK"},
      {"negative local rank",
       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "-2"}},
       {},
       "LOCAL_RANK"},
      {"port not a number", {{"MASTER_PORT", "http"}}, {}, "MASTER_PORT"},
      {"port too large", {{"MASTER_PORT", "70000"}}, {}, "MASTER_PORT"},
      {"empty master addr",
       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}},
       {},
       "MASTER_ADDR"},
      {"lws without leader",
       {{"LWS_GROUP_SIZE", "4"}, {"LWS_WORKER_INDEX", "1"}},
       {},
       "LWS_LEADER_ADDRESS"},
      {"lws without size",
       {{"LWS_LEADER_ADDRESS", "leader"}, {"LWS_WORKER_INDEX", "1"}},
       {},
       "LWS_GROUP_SIZE"},
      {"lws without index",
       {{"LWS_LEADER_ADDRESS", "leader"}, {"LWS_GROUP_SIZE", "4"}},
       {},
       "LWS_WORKER_INDEX"},
      {"lws index = size",
       {{"LWS_LEADER_ADDRESS", "leader"},
        {"LWS_GROUP_SIZE", "4"},
        {"LWS_WORKER_INDEX", "4"}},
       {},
       "LWS_WORKER_INDEX"},
      {"lws size not a number",
       {{"LWS_LEADER_ADDRESS", "leader"},
        {"LWS_GROUP_SIZE", "four"},
        {"LWS_WORKER_INDEX", "0"}},
       {},
       "LWS_GROUP_SIZE"},
      {"empty lws leader",
       {{"LWS_LEADER_ADDRESS", ""},
        {"LWS_GROUP_SIZE", "4"},
        {"LWS_WORKER_INDEX", "0"}},
       {},
       "LWS_LEADER_ADDRESS"},
      {"rank flag outside world", {}, RankFlags(5, 4), "--rank"},
      {"world flag zero", {}, RankFlags(0, 0), "--world-size"},
      {"port flag", {}, bad_port, "--master-port"},
      {"addr flag", {}, empty_addr, "--master-addr"},
  };
  for (const MalformedCase& c : cases) {
    absl::Status status =
        ResolveRankEnv(c.overrides, LookupIn(c.vars)).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.label;
    EXPECT_THAT(std::string(status.message()), StartsWith(c.named + ":"))
        << c.label;
  }
}

std::string Label(const std::vector<MeshDim>& dims) {
  return absl::StrJoin(dims, "+", [](std::string* out, MeshDim dim) {
    out->append(MeshDimName(dim));
  });
}

double PowerOfTwo(int rank) { return std::ldexp(1.0, rank); }

// The ranks whose coordinates equal `rank`'s on every world dim outside
// `dims`: group membership from coordinates, not from Mesh::GroupRanks.
std::vector<int> MembersByCoordinates(const MeshShape& shape, int rank,
                                      const std::vector<MeshDim>& dims) {
  const Mesh me = Mesh::Create(shape, rank).value();
  std::vector<int> members;
  for (int other = 0; other < shape.world_size(); ++other) {
    const Mesh them = Mesh::Create(shape, other).value();
    bool same = true;
    for (MeshDim dim : kWorldDims) {
      const bool spanned =
          std::find(dims.begin(), dims.end(), dim) != dims.end();
      same &= spanned || me.coord(dim) == them.coord(dim);
    }
    if (same) members.push_back(other);
  }
  return members;
}

// Every created group reduces 2^rank over exactly the ranks it should hold,
// and reduce-scatters each member its own slice of the sum.
absl::Status CheckEveryGroupHoldsItsRanks(const Mesh& mesh,
                                          ProcessGroups& groups) {
  for (const std::vector<MeshDim>& dims : ProcessGroups::CreatedGroupDims()) {
    const std::string label = Label(dims);
    const std::vector<int> members =
        MembersByCoordinates(mesh.shape(), mesh.rank(), dims);
    EXPECT_EQ(mesh.GroupRanks(dims), members) << label;
    TALLY_ASSIGN_OR_RETURN(Communicator * group, groups.group(dims));
    const int index = static_cast<int>(
        std::find(members.begin(), members.end(), mesh.rank()) -
        members.begin());
    EXPECT_EQ(group->size(), static_cast<int>(members.size())) << label;
    EXPECT_EQ(group->rank(), index) << label;

    torch::Tensor value =
        torch::full({3}, PowerOfTwo(mesh.rank()), torch::kFloat64);
    TALLY_RETURN_IF_ERROR(group->AllReduce(value, ReduceOp::kSum));
    double expected = 0;
    for (int r : members) expected += PowerOfTwo(r);
    EXPECT_TRUE(
        torch::equal(value, torch::full({3}, expected, torch::kFloat64)))
        << label << ": got " << value << ", want " << expected;

    // Element i of rank r's input is 2^r * (i + 1); member k keeps slice k.
    const int64_t slice = 2;
    const int64_t length = slice * group->size();
    torch::Tensor input =
        torch::arange(1, length + 1, torch::kFloat64) * PowerOfTwo(mesh.rank());
    TALLY_ASSIGN_OR_RETURN(torch::Tensor mine, group->ReduceScatter(input));
    std::vector<double> want;
    for (int64_t i = index * slice; i < (index + 1) * slice; ++i) {
      double sum = 0;
      for (int r : members) sum += PowerOfTwo(r) * static_cast<double>(i + 1);
      want.push_back(sum);
    }
    EXPECT_TRUE(torch::equal(mine, torch::tensor(want, torch::kFloat64)))
        << label << " reduce-scatter: got " << mine;
  }
  return absl::OkStatus();
}

// All-reduce, all-gather order, broadcast from the last rank, reduce-scatter
// and send/recv over the world group, then its counters.
absl::Status CheckWorldCollectives(Communicator& world) {
  const int rank = world.rank();
  const int size = world.size();
  const int64_t f64 = sizeof(double);

  torch::Tensor sum = torch::full({2}, PowerOfTwo(rank), torch::kFloat64);
  TALLY_RETURN_IF_ERROR(world.AllReduce(sum, ReduceOp::kSum));
  EXPECT_TRUE(torch::equal(
      sum, torch::full({2}, PowerOfTwo(size) - 1, torch::kFloat64)));

  TALLY_ASSIGN_OR_RETURN(
      torch::Tensor gathered,
      world.AllGather(torch::full({2}, rank, torch::kFloat64)));
  EXPECT_EQ(gathered.numel(), 2 * size);
  for (int r = 0; r < size && gathered.numel() == 2 * size; ++r) {
    EXPECT_EQ(gathered[2 * r].item<double>(), r) << "slot " << r;
    EXPECT_EQ(gathered[2 * r + 1].item<double>(), r) << "slot " << r;
  }

  const int root = size - 1;
  const torch::Tensor root_payload =
      torch::arange(4, torch::kFloat64) * 1.5 + root;
  torch::Tensor broadcast =
      rank == root ? root_payload.clone() : torch::zeros({4}, torch::kFloat64);
  TALLY_RETURN_IF_ERROR(world.Broadcast(broadcast, root));
  EXPECT_TRUE(torch::equal(broadcast, root_payload)) << broadcast;

  // Element i of rank r's input is 100 r + i; rank r keeps elements 2r, 2r+1.
  torch::Tensor input = torch::arange(2 * size, torch::kFloat64) + 100.0 * rank;
  TALLY_ASSIGN_OR_RETURN(torch::Tensor mine, world.ReduceScatter(input));
  for (int i = 0; i < 2 && mine.numel() == 2; ++i) {
    double want = 0;
    for (int r = 0; r < size; ++r) want += 100.0 * r + (2 * rank + i);
    EXPECT_EQ(mine[i].item<double>(), want) << "element " << i;
  }

  const int sender = 1;
  const int receiver = size - 2;
  const torch::Tensor message = torch::arange(5, torch::kFloat64) + 1000.0;
  if (rank == sender) TALLY_RETURN_IF_ERROR(world.Send(message, receiver));
  if (rank == receiver) {
    torch::Tensor received = torch::zeros({5}, torch::kFloat64);
    TALLY_RETURN_IF_ERROR(world.Recv(received, sender));
    EXPECT_TRUE(torch::equal(received, message)) << received;
  }

  // Start-up traffic is not counted: these are exactly the calls above.
  const CommStats& stats = world.stats();
  EXPECT_EQ(stats.Get(CommOp::kAllReduce).calls, 1);
  EXPECT_EQ(stats.Get(CommOp::kAllReduce).bytes, 2 * f64);
  EXPECT_EQ(stats.Get(CommOp::kAllGather).calls, 1);
  EXPECT_EQ(stats.Get(CommOp::kAllGather).bytes, 2 * f64);
  EXPECT_EQ(stats.Get(CommOp::kBroadcast).calls, 1);
  EXPECT_EQ(stats.Get(CommOp::kBroadcast).bytes, 4 * f64);
  EXPECT_EQ(stats.Get(CommOp::kReduceScatter).calls, 1);
  EXPECT_EQ(stats.Get(CommOp::kReduceScatter).bytes, 2 * size * f64);
  EXPECT_EQ(stats.Get(CommOp::kSend).calls, rank == sender ? 1 : 0);
  EXPECT_EQ(stats.Get(CommOp::kSend).bytes, rank == sender ? 5 * f64 : 0);
  EXPECT_EQ(stats.Get(CommOp::kRecv).calls, rank == receiver ? 1 : 0);
  EXPECT_EQ(stats.TotalCalls(),
            4 + (rank == sender ? 1 : 0) + (rank == receiver ? 1 : 0));
  return absl::OkStatus();
}

// Commands go over control(), whose traffic never shows in world()'s
// counters.
absl::Status CheckControlIsSeparate(ProcessGroups& groups) {
  const int64_t world_calls = groups.world().stats().TotalCalls();
  const torch::Tensor command = torch::tensor({7, 8, 9}, torch::kInt64);
  torch::Tensor received = groups.control().rank() == 0
                               ? command.clone()
                               : torch::zeros({3}, torch::kInt64);
  TALLY_RETURN_IF_ERROR(groups.control().Broadcast(received, 0));
  EXPECT_TRUE(torch::equal(received, command)) << received;
  EXPECT_EQ(groups.control().size(), groups.world().size());
  EXPECT_EQ(groups.control().stats().TotalCalls(), 1);
  EXPECT_EQ(groups.world().stats().TotalCalls(), world_calls);
  return absl::OkStatus();
}

absl::Status CheckMesh(const MeshShape& shape, const RankEnv& env) {
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroups> groups,
                         ProcessGroups::Create(env, mesh, absl::Seconds(60)));
  TALLY_RETURN_IF_ERROR(CheckEveryGroupHoldsItsRanks(mesh, *groups));
  TALLY_RETURN_IF_ERROR(CheckWorldCollectives(groups->world()));
  return CheckControlIsSeparate(*groups);
}

TEST(DistributedTest, EightRanksDpReplicateDpShardTp) {
  MeshShape shape;
  shape.dp_replicate = 2;
  shape.dp_shard = 2;
  shape.tp = 2;
  testing::RunOnRanks(
      8, [&](const RankEnv& env) { return CheckMesh(shape, env); });
}

TEST(DistributedTest, FourRanksDpShardTp) {
  MeshShape shape;
  shape.dp_shard = 2;
  shape.tp = 2;
  testing::RunOnRanks(
      4, [&](const RankEnv& env) { return CheckMesh(shape, env); });
}

TEST(DistributedTest, RanksWaitForAMasterThatStartsLate) {
  MeshShape shape;
  shape.dp_shard = 3;
  testing::RunOnRanks(3, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
    const absl::Duration master_delay = absl::Milliseconds(1500);
    if (env.rank == 0) absl::SleepFor(master_delay);
    const absl::Time start = absl::Now();
    TALLY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroups> groups,
                           ProcessGroups::Create(env, mesh, absl::Seconds(30)));
    // The other ranks really started before the store existed.
    if (env.rank != 0) {
      EXPECT_GE(absl::Now() - start, master_delay / 2);
    }
    torch::Tensor value =
        torch::full({1}, PowerOfTwo(env.rank), torch::kFloat64);
    TALLY_RETURN_IF_ERROR(groups->world().AllReduce(value, ReduceOp::kSum));
    EXPECT_EQ(value.item<double>(), PowerOfTwo(3) - 1);
    return absl::OkStatus();
  });
}

TEST(DistributedTest, MasterThatNeverComesUpTimesOut) {
  MeshShape shape;
  shape.dp_shard = 2;
  const Mesh mesh = Mesh::Create(shape, 1).value();
  RankEnv env;
  env.rank = 1;
  env.world_size = 2;
  env.master_port = testing::PickFreePort();
  ASSERT_GT(env.master_port, 0);
  const absl::Duration timeout = absl::Seconds(2);
  const absl::Time start = absl::Now();
  absl::Status status = ProcessGroups::Create(env, mesh, timeout).status();
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(absl::StrCat("127.0.0.1:", env.master_port)));
  EXPECT_GE(elapsed, timeout - absl::Milliseconds(100));
  EXPECT_LE(elapsed, timeout + absl::Seconds(1));

  env.master_addr = "tally-master.invalid";
  status = ProcessGroups::Create(env, mesh, absl::Seconds(1)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("tally-master.invalid"));
}

TEST(DistributedTest, SingleRankGroupsAreLocal) {
  std::unique_ptr<ProcessGroups> groups =
      ProcessGroups::Create(RankEnv{}, Mesh::SingleRank(), absl::Seconds(5))
          .value();
  EXPECT_EQ(groups->world().size(), 1);
  EXPECT_EQ(groups->control().size(), 1);
  for (const std::vector<MeshDim>& dims : ProcessGroups::CreatedGroupDims()) {
    Communicator* group = groups->group(dims).value();
    EXPECT_EQ(group->size(), 1) << Label(dims);
    torch::Tensor value = torch::tensor({2.5, -1.0}, torch::kFloat64);
    ASSERT_TRUE(group->AllReduce(value, ReduceOp::kSum).ok());
    EXPECT_TRUE(
        torch::equal(value, torch::tensor({2.5, -1.0}, torch::kFloat64)));
  }
  EXPECT_EQ(groups->group({MeshDim::kDpShard, MeshDim::kDpReplicate}).value(),
            groups->group({MeshDim::kDpReplicate, MeshDim::kDpShard}).value());
  EXPECT_EQ(groups->group({MeshDim::kDpShard, MeshDim::kTp}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(groups->group({MeshDim::kEp}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(groups->group({MeshDim::kTp, MeshDim::kTp}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Refused before the rendezvous: the master does not exist, so reaching
// for it would end in DEADLINE_EXCEEDED instead.
TEST(DistributedTest, CudaDeviceWithoutCudaCommunicatorIsRefusedFirst) {
  MeshShape shape;
  shape.tp = 2;
  RankEnv env;
  env.world_size = 2;
  env.master_addr = "tally-master.invalid";
  const absl::Status status =
      ProcessGroups::Create(env, Mesh::Create(shape, 0).value(),
                            absl::Seconds(30), kDefaultCollectiveTimeout,
                            torch::Device(torch::kCUDA, 0))
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("device cuda:0"));
}

TEST(DistributedTest, EnvAndMeshMustAgree) {
  MeshShape shape;
  shape.tp = 2;
  RankEnv env;
  env.world_size = 4;
  env.rank = 1;
  EXPECT_EQ(ProcessGroups::Create(env, Mesh::Create(shape, 1).value(),
                                  absl::Seconds(1))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  env.world_size = 2;
  EXPECT_EQ(ProcessGroups::Create(env, Mesh::Create(shape, 0).value(),
                                  absl::Seconds(1))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tally
