// Mesh coordinates and groups, and the communicator's collectives and
// counters on a real (one-rank) c10d Gloo group.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "runtime/parallel/communicator.h"
#include "runtime/parallel/mesh.h"

namespace tally {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(MeshTest, TpIsFastestAndCoordinatesRoundTrip) {
  MeshShape shape;
  shape.pp = 2;
  shape.dp_replicate = 2;
  shape.dp_shard = 2;
  shape.tp = 2;
  ASSERT_EQ(shape.world_size(), 16);
  for (int rank = 0; rank < shape.world_size(); ++rank) {
    Mesh mesh = Mesh::Create(shape, rank).value();
    // Row-major pp, dp_replicate, dp_shard, cp, tp.
    const int rebuilt =
        (((mesh.coord(MeshDim::kPp) * 2 + mesh.coord(MeshDim::kDpReplicate)) *
              2 +
          mesh.coord(MeshDim::kDpShard)) *
             1 +
         mesh.coord(MeshDim::kCp)) *
            2 +
        mesh.coord(MeshDim::kTp);
    EXPECT_EQ(rebuilt, rank);
  }
  Mesh mesh = Mesh::Create(shape, 5).value();  // pp0 dpr1 dps0 tp1
  EXPECT_EQ(mesh.coord(MeshDim::kTp), 1);
  EXPECT_EQ(mesh.coord(MeshDim::kDpShard), 0);
  EXPECT_EQ(mesh.coord(MeshDim::kDpReplicate), 1);
  EXPECT_EQ(mesh.GroupRanks({MeshDim::kTp}), (std::vector<int>{4, 5}));
  EXPECT_EQ(mesh.GroupRanks({MeshDim::kDpShard}), (std::vector<int>{5, 7}));
  EXPECT_EQ(mesh.GroupRanks({MeshDim::kDpReplicate, MeshDim::kDpShard}),
            (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(mesh.GroupRanks({MeshDim::kPp}), (std::vector<int>{5, 13}));
}

TEST(MeshTest, RejectsImpossibleShapesNamingTheDim) {
  MeshShape bad;
  bad.tp = 0;
  auto status = Mesh::Create(bad, 0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("mesh.tp"), std::string::npos);
  MeshShape ep;
  ep.dp_shard = 2;
  ep.ep = 4;
  EXPECT_NE(Mesh::Create(ep, 0).status().message().find("mesh.ep"),
            std::string::npos);
  EXPECT_FALSE(Mesh::Create(MeshShape{}, 1).ok());
}

TEST(CommunicatorTest, SingleRankCollectivesAndCounters) {
  auto world = MakeSingleRankCommunicator().value();
  EXPECT_EQ(world->rank(), 0);
  EXPECT_EQ(world->size(), 1);

  torch::Tensor t = torch::tensor({1.5, -2.0, 3.0}, torch::kFloat64);
  ASSERT_TRUE(world->AllReduce(t, ReduceOp::kSum).ok());
  EXPECT_TRUE(
      torch::equal(t, torch::tensor({1.5, -2.0, 3.0}, torch::kFloat64)));
  ASSERT_TRUE(world->AllReduce(t, ReduceOp::kMax).ok());

  auto gathered = world->AllGather(torch::arange(4, torch::kFloat32)).value();
  EXPECT_TRUE(torch::equal(gathered, torch::arange(4, torch::kFloat32)));
  auto scattered =
      world->ReduceScatter(torch::ones({4, 2}, torch::kFloat32)).value();
  EXPECT_TRUE(torch::equal(scattered, torch::ones({4, 2}, torch::kFloat32)));
  ASSERT_TRUE(world->Broadcast(t, 0).ok());

  const CommStats& stats = world->stats();
  EXPECT_EQ(stats.Get(CommOp::kAllReduce).calls, 2);
  EXPECT_EQ(stats.Get(CommOp::kAllReduce).bytes, 2 * 3 * 8);
  EXPECT_EQ(stats.Get(CommOp::kAllGather).bytes, 4 * 4);
  EXPECT_EQ(stats.Get(CommOp::kReduceScatter).calls, 1);
  EXPECT_EQ(stats.Get(CommOp::kBroadcast).calls, 1);
  EXPECT_EQ(stats.TotalCalls(), 5);

  // A reduce-scatter whose dim 0 does not split is refused, not truncated.
  auto empty = world->ReduceScatter(torch::ones({}, torch::kFloat32));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
}

// This binary links no NCCL communicator, and Debian's LibTorch has no CUDA:
// a CUDA device is refused with the missing piece, never run on the CPU.
TEST(CommunicatorTest, CudaSingleRankWithoutCudaCommunicatorIsRefused) {
  const absl::Status status =
      MakeSingleRankCommunicator(torch::Device(torch::kCUDA, 0)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), StartsWith("device cuda:0: "));
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(TALLY_TORCH_CUDA ? "no NCCL communicator"
                                         : "built without CUDA"));
}

TEST(CommunicatorTest, DeviceWithoutCommunicatorIsInvalidArgument) {
  const absl::Status status =
      MakeSingleRankCommunicator(torch::Device(torch::kMeta)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), StartsWith("device: meta "));
}

}  // namespace
}  // namespace tally
