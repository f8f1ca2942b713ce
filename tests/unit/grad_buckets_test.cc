// The bucketed dp_replicate gradient all-reduce: one collective per bucket
// (Communicator counters) and the same sums as one all-reduce per gradient.
#include "runtime/grad_buckets.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/distributed.h"
#include "runtime/mesh.h"
#include "runtime/status.h"
#include "tests/testing/multirank.h"

namespace tally {
namespace {

// Float gradients of odd sizes (one of them non-contiguous, one undefined)
// whose values depend on `rank`, so a sum over ranks is recognizable.
std::vector<Parameter> MakeParameters(int rank) {
  std::vector<Parameter> params;
  for (int64_t numel : {1, 1000, 7, 4096, 0, 333, 25}) {
    Parameter p;
    p.name = "p" + std::to_string(params.size());
    p.tensor = torch::zeros({numel});
    p.tensor.mutable_grad() =
        torch::arange(numel, torch::kFloat) * (rank + 1) + numel;
    params.push_back(p);
  }
  params[3].tensor = torch::zeros({64, 64});
  params[3].tensor.mutable_grad() =
      (torch::arange(4096, torch::kFloat).view({64, 64}) * (rank + 1)).t();
  params.push_back({"no_grad", torch::zeros({5}), {}, false});
  return params;
}

int64_t GradientBytes(const std::vector<Parameter>& params) {
  int64_t bytes = 0;
  for (const Parameter& p : params) {
    if (p.tensor.grad().defined()) bytes += p.tensor.grad().nbytes();
  }
  return bytes;
}

TEST(GradBucketsTest, OneCollectivePerBucketAndUnchangedValuesOnOneRank) {
  std::unique_ptr<Communicator> group = MakeSingleRankCommunicator().value();
  const int64_t total = GradientBytes(MakeParameters(0));
  for (int64_t bucket : {int64_t{4}, int64_t{1000}, int64_t{4096}, total - 1,
                         total, int64_t{25} << 20}) {
    SCOPED_TRACE(bucket);
    std::vector<Parameter> params = MakeParameters(0);
    const std::vector<Parameter> expected = MakeParameters(0);
    group->stats().Reset();
    ASSERT_TRUE(AllReduceGradientsInBuckets(params, *group, bucket).ok());
    EXPECT_EQ(group->stats().Get(CommOp::kAllReduce).calls,
              (total + bucket - 1) / bucket);
    EXPECT_EQ(group->stats().Get(CommOp::kAllReduce).bytes, total);
    for (size_t i = 0; i < params.size(); ++i) {
      if (!expected[i].tensor.grad().defined()) {
        EXPECT_FALSE(params[i].tensor.grad().defined());
        continue;
      }
      EXPECT_TRUE(
          torch::equal(params[i].tensor.grad(), expected[i].tensor.grad()))
          << i;
    }
  }
}

TEST(GradBucketsTest, DtypesAreBucketedSeparately) {
  std::unique_ptr<Communicator> group = MakeSingleRankCommunicator().value();
  std::vector<Parameter> params = MakeParameters(0);
  params[1].tensor.mutable_grad() = params[1].tensor.grad().to(torch::kDouble);
  const int64_t float_bytes = GradientBytes(params) - 8000;
  const int64_t bucket = 1024;
  group->stats().Reset();
  ASSERT_TRUE(AllReduceGradientsInBuckets(params, *group, bucket).ok());
  EXPECT_EQ(group->stats().Get(CommOp::kAllReduce).calls,
            (float_bytes + bucket - 1) / bucket + (8000 + bucket - 1) / bucket);
  EXPECT_EQ(params[1].tensor.grad().scalar_type(), torch::kDouble);
}

TEST(GradBucketsTest, RejectsAnEmptyBucket) {
  std::unique_ptr<Communicator> group = MakeSingleRankCommunicator().value();
  std::vector<Parameter> params = MakeParameters(0);
  EXPECT_EQ(AllReduceGradientsInBuckets(params, *group, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(group->stats().TotalCalls(), 0);
}

// Over three real ranks every gradient becomes the sum of the ranks'
// gradients, computed independently here.
TEST(GradBucketsTest, SumsOverRanksLikeOneAllReducePerGradient) {
  constexpr int kRanks = 3;
  testing::RunOnRanks(kRanks, [](const RankEnv& env) -> absl::Status {
    MeshShape shape;
    shape.dp_replicate = kRanks;
    TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
    TALLY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroups> groups,
                           ProcessGroups::Create(env, mesh, absl::Seconds(60)));
    std::vector<Parameter> params = MakeParameters(env.rank);
    const int64_t bucket = 1000;  // buckets straddle gradients
    TALLY_RETURN_IF_ERROR(
        AllReduceGradientsInBuckets(params, groups->world(), bucket));
    for (size_t i = 0; i < params.size(); ++i) {
      torch::Tensor expected;
      for (int rank = 0; rank < kRanks; ++rank) {
        const torch::Tensor g = MakeParameters(rank)[i].tensor.grad();
        if (!g.defined()) break;
        expected = expected.defined() ? expected + g : g;
      }
      if (!expected.defined()) continue;
      EXPECT_TRUE(torch::equal(params[i].tensor.grad(), expected)) << i;
    }
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace tally
