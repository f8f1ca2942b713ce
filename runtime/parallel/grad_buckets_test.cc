// The bucketed dp_replicate gradient all-reduce: one collective per bucket
// (Communicator counters) and the same sums as one all-reduce per gradient;
// overlapped with backward, buckets start from gradient hooks before
// backward returns and the sums are bitwise those of the post-backward path.
#include "runtime/parallel/grad_buckets.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "base/status.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/mesh.h"
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

// A chain whose backward produces the gradients from the last parameter to
// the first: loss = prod_i sum(w_i * x_i) over the used w_i, so each w_i's
// gradient waits for those after it. "unused" never gets a gradient.
// Sizes (float): w0 7, unused 5, w1 13, w2 11, w3 9.
std::vector<Parameter> MakeChain() {
  std::vector<Parameter> params;
  for (const auto& [name, numel] : std::vector<std::pair<const char*, int64_t>>{
           {"w0", 7}, {"unused", 5}, {"w1", 13}, {"w2", 11}, {"w3", 9}}) {
    Parameter p;
    p.name = name;
    p.tensor = (torch::arange(numel, torch::kFloat) / (10 * numel) + 0.9)
                   .requires_grad_();
    params.push_back(std::move(p));
  }
  return params;
}

// The inputs of `rank`'s micro-batch `batch`, one per used parameter.
std::vector<torch::Tensor> ChainInputs(const std::vector<Parameter>& params,
                                       int rank, int batch) {
  std::vector<torch::Tensor> inputs;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].tensor.numel();
    inputs.push_back(torch::linspace(0.5, 1.5, n, torch::kFloat) *
                     (1.0 + 0.25 * rank + 0.125 * batch) / n);
  }
  return inputs;
}

// The loss of one micro-batch; `first_hook` runs when the gradient of the
// first (w0) factor is computed, i.e. late in backward.
torch::Tensor ChainLoss(const std::vector<Parameter>& params,
                        const std::vector<torch::Tensor>& inputs,
                        std::function<void()> first_hook = nullptr) {
  torch::Tensor loss;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].name == "unused") continue;
    torch::Tensor factor = (params[i].tensor * inputs[i]).sum();
    if (!loss.defined()) {
      if (first_hook) {
        factor.register_hook([first_hook](torch::Tensor) { first_hook(); });
      }
      loss = factor;
    } else {
      loss = loss * factor;
    }
  }
  return loss;
}

// Two micro-batches of `rank` backward on fresh parameters: the local
// gradients before any sum.
std::vector<torch::Tensor> LocalChainGradients(int rank) {
  std::vector<Parameter> params = MakeChain();
  for (int batch = 0; batch < 2; ++batch) {
    ChainLoss(params, ChainInputs(params, rank, batch)).backward();
  }
  std::vector<torch::Tensor> grads;
  for (const Parameter& p : params) grads.push_back(p.tensor.grad());
  return grads;
}

constexpr int64_t kChainBucketBytes = 40;  // 10 floats: buckets straddle

TEST(GradBucketsTest, OverlappedSumRejectsAnEmptyBucket) {
  std::unique_ptr<Communicator> group = MakeSingleRankCommunicator().value();
  EXPECT_EQ(OverlappedGradientSum::Create({{group.get(), MakeChain()}}, 0)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OverlappedGradientSum::Create({{nullptr, MakeChain()}}, 40)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// This rank's groups on a dp_replicate = 2 mesh (its world: the pair).
absl::StatusOr<std::unique_ptr<ProcessGroups>> ReplicaPairGroups(
    const RankEnv& env) {
  MeshShape shape;
  shape.dp_replicate = 2;
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
  return ProcessGroups::Create(env, mesh, absl::Seconds(60), absl::Seconds(20));
}

// Two ranks, two micro-batches, only the second armed. Laid out from w3 to
// w0 with "unused" in it, the planned buckets are [w3, w2 | w2 | w1 | w1,
// unused, w0 | w0]: the first three start during the armed backward, the
// one holding "unused" never does, and Finish lays out what is left without
// it. The sums equal the two ranks' local gradients added here, and the
// post-backward AllReduceGradientsInBuckets, bit for bit.
TEST(GradBucketsTest, OverlappedSumStartsBucketsDuringBackward) {
  testing::RunOnRanks(2, [](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroups> groups,
                           ReplicaPairGroups(env));
    Communicator& group = groups->world();

    std::vector<Parameter> params = MakeChain();
    TALLY_ASSIGN_OR_RETURN(
        std::unique_ptr<OverlappedGradientSum> sum,
        OverlappedGradientSum::Create({{&group, params}}, kChainBucketBytes));
    group.stats().Reset();
    ChainLoss(params, ChainInputs(params, env.rank, 0)).backward();
    EXPECT_EQ(sum->started_by_hooks(), 0);  // not armed: accumulates only
    EXPECT_EQ(group.stats().Get(CommOp::kAllReduce).calls, 0);

    sum->Arm();
    int64_t started_before_w0 = -1;
    ChainLoss(params, ChainInputs(params, env.rank, 1), [&] {
      started_before_w0 = group.stats().Get(CommOp::kAllReduce).calls;
    }).backward();
    EXPECT_GE(started_before_w0, 1);
    EXPECT_EQ(sum->started_by_hooks(), 3);
    TALLY_RETURN_IF_ERROR(sum->Finish());
    // ceil(40 floats with a gradient / 10) collectives in all.
    EXPECT_EQ(group.stats().Get(CommOp::kAllReduce).calls, 4);
    EXPECT_EQ(group.stats().Get(CommOp::kAllReduce).bytes, 40 * 4);

    std::vector<Parameter> reference = MakeChain();
    for (int batch = 0; batch < 2; ++batch) {
      ChainLoss(reference, ChainInputs(reference, env.rank, batch)).backward();
    }
    TALLY_RETURN_IF_ERROR(
        AllReduceGradientsInBuckets(reference, group, kChainBucketBytes));
    const std::vector<torch::Tensor> rank0 = LocalChainGradients(0);
    const std::vector<torch::Tensor> rank1 = LocalChainGradients(1);
    for (size_t i = 0; i < params.size(); ++i) {
      SCOPED_TRACE(params[i].name);
      const torch::Tensor& got = params[i].tensor.grad();
      if (params[i].name == "unused") {
        EXPECT_FALSE(got.defined());
        EXPECT_FALSE(reference[i].tensor.grad().defined());
        continue;
      }
      EXPECT_TRUE(torch::equal(got, rank0[i] + rank1[i]));
      EXPECT_TRUE(torch::equal(got, reference[i].tensor.grad()));
    }
    return absl::OkStatus();
  });
}

// A step given up without Finish (here: rank 1 failed before its armed
// backward) still issues every planned bucket on every rank, so the group
// pairs the next collective correctly.
TEST(GradBucketsTest, OverlappedSumAbandonedKeepsTheGroupInStep) {
  testing::RunOnRanks(2, [](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroups> groups,
                           ReplicaPairGroups(env));
    Communicator& group = groups->world();
    std::vector<Parameter> params = MakeChain();
    group.stats().Reset();
    {
      TALLY_ASSIGN_OR_RETURN(
          std::unique_ptr<OverlappedGradientSum> sum,
          OverlappedGradientSum::Create({{&group, params}}, kChainBucketBytes));
      if (env.rank == 0) sum->Arm();
      ChainLoss(params, ChainInputs(params, env.rank, 0)).backward();
      EXPECT_EQ(sum->started_by_hooks(), env.rank == 0 ? 3 : 0);
    }
    // ceil(45 planned floats / 10) on both ranks.
    EXPECT_EQ(group.stats().Get(CommOp::kAllReduce).calls, 5);
    torch::Tensor value = torch::full({3}, env.rank + 1.0);
    TALLY_RETURN_IF_ERROR(group.AllReduce(value, ReduceOp::kSum));
    EXPECT_TRUE(torch::equal(value, torch::full({3}, 3.0)));
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace tally
