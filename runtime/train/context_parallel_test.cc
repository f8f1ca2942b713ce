// Context parallelism below the engine: the zigzag token split, the split
// batch and attention layout, and the sample-mean normalizer. The engine's
// cp meshes are checked end to end against the single-device run in
// multirank_golden_test.cc.
#include "runtime/train/context_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "base/status.h"
#include "runtime/model/llama_model.h"
#include "runtime/parallel/distributed.h"
#include "runtime/train/accumulation.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::RelativeDiff;

TEST(ContextParallelPositionsTest, EveryTokenBelongsToExactlyOneRank) {
  for (int cp : {1, 2, 3, 4}) {
    for (int64_t length = 1; length <= 40; ++length) {
      std::multiset<int64_t> seen;
      for (int r = 0; r < cp; ++r) {
        std::vector<int64_t> mine = ContextParallelPositions(length, r, cp);
        EXPECT_TRUE(std::is_sorted(mine.begin(), mine.end()));
        seen.insert(mine.begin(), mine.end());
      }
      ASSERT_EQ(static_cast<int64_t>(seen.size()), length);
      for (int64_t t = 0; t < length; ++t) {
        EXPECT_EQ(seen.count(t), 1u) << "cp " << cp << " length " << length;
      }
    }
  }
}

TEST(ContextParallelPositionsTest, BalancesCausalAttentionWork) {
  // Query t of a causal sample reads t + 1 keys. With the length a multiple
  // of 2 cp, pairing chunk i with chunk 2cp - 1 - i gives every rank the same
  // token count and the same number of query-key pairs.
  for (int cp : {2, 3, 4}) {
    const int64_t length = 2 * cp * 5;
    std::set<int64_t> tokens, work;
    for (int r = 0; r < cp; ++r) {
      int64_t pairs = 0;
      std::vector<int64_t> mine = ContextParallelPositions(length, r, cp);
      for (int64_t t : mine) pairs += t + 1;
      tokens.insert(static_cast<int64_t>(mine.size()));
      work.insert(pairs);
    }
    EXPECT_EQ(tokens.size(), 1u) << cp;
    EXPECT_EQ(work.size(), 1u) << cp;
  }
}

// The full batch of `samples`, and every cp rank's split of it.
struct Splits {
  PackedBatch full;
  std::vector<ContextParallelBatch> ranks;
};

Splits SplitAll(const std::vector<Sample>& samples, int cp) {
  std::vector<int> rows(samples.size());
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int>(i);
  Splits splits;
  splits.full = PackRows(samples, rows, torch::kFloat64);
  for (int r = 0; r < cp; ++r) {
    splits.ranks.push_back(SplitForContextParallel(splits.full, r, cp));
  }
  return splits;
}

std::vector<Sample> UnevenSamples() {
  const int64_t vocab = testing::TinyConfig().vocab_size;
  std::vector<Sample> samples = testing::MakeSamples(vocab, {9, 0, 4}, 7);
  samples.push_back(testing::MakeSampleValidAt(vocab, 16, {0, 1, 2, 6, 7}, 8));
  samples.push_back(testing::MakeSample(vocab, 1, 1, 9));
  samples.push_back(testing::MakeSample(vocab, 3, 2, 10));
  return samples;
}

TEST(SplitForContextParallelTest, RanksTogetherHoldTheBatchOnce) {
  const std::vector<Sample> samples = UnevenSamples();
  for (int cp : {2, 3, 4}) {
    Splits s = SplitAll(samples, cp);
    const int64_t rows = s.full.inputs.size(0);
    torch::Tensor covered = torch::zeros_like(s.full.inputs);
    int64_t valid = 0;
    const int64_t block = s.ranks[0].local.inputs.size(1);
    for (int r = 0; r < cp; ++r) {
      const ContextParallelBatch& split = s.ranks[r];
      EXPECT_EQ(split.local.inputs.sizes(),
                (std::vector<int64_t>{rows, block}));
      EXPECT_EQ(split.local.sample_index, s.full.sample_index);
      // Every rank names the same keys: rank q's block is q's positions.
      EXPECT_TRUE(torch::equal(split.layout.key_positions,
                               s.ranks[0].layout.key_positions));
      EXPECT_TRUE(
          torch::equal(split.layout.key_positions.narrow(1, r * block, block),
                       split.layout.positions));
      valid += split.local.valid.sum().item<int64_t>();
      for (int64_t b = 0; b < rows; ++b) {
        for (int64_t t = 0; t < block; ++t) {
          const bool real = t < split.local.lengths[b];
          EXPECT_EQ(split.layout.key_valid[b][r * block + t].item<bool>(),
                    real);
          if (!real) {
            EXPECT_FALSE(split.local.valid[b][t].item<bool>());
            EXPECT_EQ(split.local.weights[b][t].item<double>(), 0.0);
            continue;
          }
          const int64_t pos = split.layout.positions[b][t].item<int64_t>();
          covered[b][pos] += 1;
          for (const auto& [got, want] :
               {std::pair{split.local.inputs, s.full.inputs},
                {split.local.targets, s.full.targets},
                {split.local.has_target, s.full.has_target},
                {split.local.valid, s.full.valid},
                {split.local.weights, s.full.weights}}) {
            EXPECT_TRUE(torch::equal(got[b][t], want[b][pos]));
          }
        }
      }
    }
    EXPECT_EQ(valid, s.full.valid.sum().item<int64_t>());
    for (int64_t b = 0; b < rows; ++b) {
      EXPECT_TRUE(torch::equal(covered[b].narrow(0, 0, s.full.lengths[b]),
                               torch::ones({s.full.lengths[b]}, torch::kInt64)))
          << "row " << b;
    }
  }
}

TEST(SplitForContextParallelTest, UnevenShardsOfOneSample) {
  // The 16-token sample with valid targets at {0, 1, 2, 6, 7}.
  Splits s = SplitAll({UnevenSamples()[3]}, 2);
  EXPECT_EQ(s.ranks[0].local.valid.sum().item<int64_t>(), 3);
  EXPECT_EQ(s.ranks[1].local.valid.sum().item<int64_t>(), 2);
  s = SplitAll({UnevenSamples()[3]}, 4);
  std::vector<int64_t> valid;
  for (const ContextParallelBatch& split : s.ranks) {
    valid.push_back(split.local.valid.sum().item<int64_t>());
  }
  EXPECT_EQ(valid, (std::vector<int64_t>{2, 1, 0, 2}));
}

// Runs the cp = 2 forward/backward of `samples` with SAMPLE_MEAN, the
// normalizer of each row being T_b over the cp group (`all_reduce_counts`)
// or the local shard's count, and returns the gradients summed over cp.
absl::StatusOr<std::vector<torch::Tensor>> CpSampleMeanGradients(
    CausalLm& model, Communicator& cp, const std::vector<Sample>& samples,
    bool all_reduce_counts) {
  ZeroGradients(model.parameters());
  Splits s = SplitAll(samples, cp.size());
  const ContextParallelBatch& mine = s.ranks[cp.rank()];
  torch::Tensor counts = mine.local.valid.sum(1);
  if (all_reduce_counts) {
    torch::Tensor summed = counts.to(torch::kFloat64);
    TALLY_RETURN_IF_ERROR(cp.AllReduce(summed, ReduceOp::kSum));
    counts = summed.to(torch::kInt64);
  }
  TALLY_RETURN_IF_ERROR(CatchTorch("cp backward", [&] {
    torch::Tensor logprobs = model.TargetLogprobs(
        mine.local.inputs, mine.local.targets, mine.layout);
    ComputeLoss(logprobs, mine.local, LossReduction::kSampleMean, counts)
        .raw_loss.backward();
  }));
  std::vector<torch::Tensor> grads;
  for (Parameter& p : model.parameters()) {
    torch::Tensor g = p.tensor.grad().clone();
    TALLY_RETURN_IF_ERROR(cp.AllReduce(g, ReduceOp::kSum));
    grads.push_back(g);
  }
  return grads;
}

// The deliberately wrong variant (each shard divides by its own valid
// count) must differ from the single-device gradient; the all-reduced T_b
// must match it.
TEST(ContextParallelSampleMeanTest, LocalShardCountsAreWrong) {
  testing::RunOnRanks(2, [](const RankEnv& env) -> absl::Status {
    MeshShape shape;
    shape.cp = 2;
    TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
    TALLY_ASSIGN_OR_RETURN(auto groups,
                           ProcessGroups::Create(env, mesh, absl::Seconds(60)));
    TALLY_ASSIGN_OR_RETURN(Communicator * cp, groups->group({MeshDim::kCp}));
    const LlamaConfig config = testing::TinyConfig();
    ModelSharding sharding;
    sharding.cp = cp;
    TALLY_ASSIGN_OR_RETURN(
        auto model, LlamaModel::Create(config, DType::kFloat64, 3, sharding));
    TALLY_ASSIGN_OR_RETURN(auto reference,
                           LlamaModel::Create(config, DType::kFloat64, 3));
    const std::vector<Sample> samples = UnevenSamples();

    PackedBatch full = SplitAll(samples, 1).full;
    TALLY_RETURN_IF_ERROR(CatchTorch("reference backward", [&] {
      torch::Tensor logprobs = reference->TargetLogprobs(
          full.inputs, full.targets,
          AttentionLayout::RightPadded(full.lengths, full.inputs.size(1)));
      ComputeLoss(logprobs, full, LossReduction::kSampleMean)
          .raw_loss.backward();
    }));
    TALLY_ASSIGN_OR_RETURN(std::vector<torch::Tensor> exact,
                           CpSampleMeanGradients(*model, *cp, samples,
                                                 /*all_reduce_counts=*/true));
    TALLY_ASSIGN_OR_RETURN(std::vector<torch::Tensor> local,
                           CpSampleMeanGradients(*model, *cp, samples,
                                                 /*all_reduce_counts=*/false));
    double worst_exact = 0, worst_local = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      const torch::Tensor& want = reference->parameters()[i].tensor.grad();
      worst_exact = std::max(worst_exact, RelativeDiff(exact[i], want));
      worst_local = std::max(worst_local, RelativeDiff(local[i], want));
    }
    EXPECT_LT(worst_exact, 1e-10);
    EXPECT_GT(worst_local, 1e-3);
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace tally
