// The ZeRO-3 gather and the Megatron tensor-parallel ops on real multi-rank
// Gloo groups (one thread per rank, in process), against single-device
// references in fp64, with the collectives each op issues counted.
#include "runtime/parallel/parallel_ops.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <vector>

#include "base/status.h"
#include "runtime/parallel/communicator.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::tally::testing::RelativeDiff;

// Runs `body` once per rank of a `world`-rank Gloo group, each rank on its own
// thread over one shared in-memory store, and returns every rank's outcome.
// A short Gloo timeout turns a collective mismatch into a failure, not a hang.
std::vector<absl::Status> RunOnRanks(
    int world, const std::function<void(Communicator&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<absl::Status> statuses(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      statuses[rank] = CatchTorch("rank body", [&]() -> absl::Status {
        auto options = c10d::ProcessGroupGloo::Options::create(
            std::chrono::milliseconds(15000));
        options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(
            store, rank, world, options);
        TALLY_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> communicator,
                               MakeProcessGroupCommunicator(std::move(group)));
        body(*communicator);
        return absl::OkStatus();
      });
    });
  }
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

void ExpectAllRanksOk(const std::vector<absl::Status>& statuses) {
  for (size_t rank = 0; rank < statuses.size(); ++rank) {
    EXPECT_TRUE(statuses[rank].ok())
        << "rank " << rank << ": " << statuses[rank];
  }
}

const std::vector<torch::ScalarType> kDtypes = {torch::kFloat64,
                                                torch::kFloat32};

double Tolerance(torch::ScalarType dtype) {
  return dtype == torch::kFloat64 ? 1e-12 : 1e-5;
}

torch::Tensor Random(std::vector<int64_t> sizes, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn(sizes, generator, torch::kFloat64);
}

// An fp64 reference leaf holding `t` rounded to the tested dtype, so the
// reference sees the same numbers and only the ops' arithmetic differs.
torch::Tensor ReferenceLeaf(const torch::Tensor& t, torch::ScalarType dtype) {
  return t.to(dtype).to(torch::kFloat64).clone().requires_grad_();
}

// A fresh leaf of `dtype` that shares nothing with `t` (which other rank
// threads read concurrently).
torch::Tensor Leaf(const torch::Tensor& t, torch::ScalarType dtype) {
  return t.to(dtype).clone().requires_grad_();
}

void ExpectClose(const torch::Tensor& actual, const torch::Tensor& expected,
                 double tolerance, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_LE(RelativeDiff(actual, expected), tolerance) << what;
}

// Per rank and dtype: what the test body observed.
struct RankResult {
  torch::Tensor value;
  torch::Tensor grad;  // the rank-local input's (or shard's) gradient
  // Full gradients of sharded weights, gathered over the group after the
  // counted collectives.
  std::vector<torch::Tensor> gathered_grads;
  int64_t forward_all_reduces = -1;
  int64_t forward_all_reduce_bytes = -1;
  int64_t forward_calls = -1;
  int64_t backward_calls = -1;  // collectives issued by backward alone
};

TEST(ParallelOpsTest, ShardsArePaddedCeilSlicesOfDim0) {
  EXPECT_EQ(ShardRows(7, 2), 4);
  EXPECT_EQ(ShardRows(7, 3), 3);
  EXPECT_EQ(ShardRows(6, 3), 2);
  EXPECT_EQ(ShardRows(2, 3), 1);
  EXPECT_EQ(ShardRows(5, 1), 5);

  const torch::Tensor full = Random({7, 2}, 1);
  for (int size : {1, 2, 3, 4}) {
    const int64_t rows = (7 + size - 1) / size;
    for (int rank = 0; rank < size; ++rank) {
      torch::Tensor shard = ShardDim0(full, rank, size);
      ASSERT_EQ(shard.sizes(), (std::vector<int64_t>{rows, 2}));
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t global_row = rank * rows + row;
        torch::Tensor expected = global_row < 7
                                     ? full[global_row]
                                     : torch::zeros({2}, full.options());
        EXPECT_TRUE(torch::equal(shard[row], expected))
            << "size " << size << " rank " << rank << " row " << row;
      }
    }
  }
  // A 1-row tensor over 3 ranks: ranks 1 and 2 hold only padding.
  torch::Tensor one_row = Random({1, 3}, 2);
  EXPECT_TRUE(torch::equal(ShardDim0(one_row, 0, 3), one_row));
  EXPECT_TRUE(torch::equal(ShardDim0(one_row, 2, 3),
                           torch::zeros({1, 3}, torch::kFloat64)));
}

// ZeRO-3: rank r computes loss_r = 2^r * ||W x_r||^2 with its own x_r through
// the gathered W. Each shard's gradient must be its rows of
// d(sum_r loss_r)/dW: the 2^r weights prove a SUM over exactly this group
// (an average, or a missing or repeated rank, gives another number).
TEST(ParallelOpsTest, GatherShardedParameterReduceScattersSummedGradients) {
  struct Case {
    int64_t full_rows;
    int shards;
  };
  for (const Case& c : {Case{7, 2}, Case{7, 3}, Case{2, 3}}) {
    SCOPED_TRACE("rows " + std::to_string(c.full_rows) + " shards " +
                 std::to_string(c.shards));
    const int64_t shard_rows = (c.full_rows + c.shards - 1) / c.shards;
    const torch::Tensor weight = Random({c.full_rows, 4}, 10);
    std::vector<torch::Tensor> inputs;
    for (int rank = 0; rank < c.shards; ++rank) {
      inputs.push_back(Random({4, 3}, 20 + rank));
    }
    auto loss = [&](const torch::Tensor& w, int rank) {
      return w.matmul(inputs[rank].to(w.scalar_type())).pow(2).sum() *
             std::pow(2.0, rank);
    };

    std::vector<std::vector<RankResult>> results(
        kDtypes.size(), std::vector<RankResult>(c.shards));
    ExpectAllRanksOk(RunOnRanks(c.shards, [&](Communicator& group) {
      for (size_t d = 0; d < kDtypes.size(); ++d) {
        RankResult& result = results[d][group.rank()];
        group.stats().Reset();
        torch::Tensor shard =
            Leaf(ShardDim0(weight, group.rank(), group.size()), kDtypes[d]);
        torch::Tensor full = GatherShardedParameter(shard, c.full_rows, group);
        result.value = full.detach().clone();
        result.forward_calls = group.stats().TotalCalls();
        EXPECT_EQ(group.stats().Get(CommOp::kAllGather).calls, 1);
        loss(full, group.rank()).backward();
        result.backward_calls =
            group.stats().TotalCalls() - result.forward_calls;
        EXPECT_EQ(group.stats().Get(CommOp::kReduceScatter).calls, 1);
        result.grad = shard.grad().clone();
      }
    }));

    for (size_t d = 0; d < kDtypes.size(); ++d) {
      SCOPED_TRACE(c10::toString(kDtypes[d]));
      torch::Tensor reference = ReferenceLeaf(weight, kDtypes[d]);
      torch::Tensor total = torch::zeros({}, torch::kFloat64);
      for (int rank = 0; rank < c.shards; ++rank) {
        total = total + loss(reference, rank);
      }
      total.backward();
      for (int rank = 0; rank < c.shards; ++rank) {
        const RankResult& result = results[d][rank];
        EXPECT_TRUE(torch::equal(result.value, weight.to(kDtypes[d])));
        EXPECT_EQ(result.forward_calls, 1);
        EXPECT_EQ(result.backward_calls, 1);
        ASSERT_EQ(result.grad.sizes(), (std::vector<int64_t>{shard_rows, 4}));
        const int64_t start = std::min(rank * shard_rows, c.full_rows);
        const int64_t present = std::min(shard_rows, c.full_rows - start);
        if (present > 0) {
          ExpectClose(result.grad.narrow(0, 0, present),
                      reference.grad().narrow(0, start, present),
                      Tolerance(kDtypes[d]),
                      "shard grad rank " + std::to_string(rank));
        }
        EXPECT_TRUE(result.grad.narrow(0, present, shard_rows - present)
                        .eq(0)
                        .all()
                        .item<bool>())
            << "padding rows of rank " << rank;
      }
    }
  }
}

// Megatron MLP y = W2 gelu(W1 x) with W1 split by rows (column-parallel) and
// W2 by columns (row-parallel) over tp = 2.
TEST(ParallelOpsTest, TensorParallelMlpMatchesUnsplitMlp) {
  constexpr int kTp = 2;
  constexpr int64_t kHidden = 4;
  constexpr int64_t kIntermediate = 6;
  constexpr int64_t kLocal = kIntermediate / kTp;
  const torch::Tensor x = Random({3, 2, kHidden}, 30);
  const torch::Tensor w1 = Random({kIntermediate, kHidden}, 31);
  const torch::Tensor w2 = Random({kHidden, kIntermediate}, 32);
  const torch::Tensor probe = Random({3, 2, kHidden}, 33);
  auto loss = [&](const torch::Tensor& y) {
    return (y.pow(2) * probe.to(y.scalar_type())).sum();
  };

  std::vector<std::vector<RankResult>> results(kDtypes.size(),
                                               std::vector<RankResult>(kTp));
  ExpectAllRanksOk(RunOnRanks(kTp, [&](Communicator& tp) {
    const int64_t first = tp.rank() * kLocal;
    for (size_t d = 0; d < kDtypes.size(); ++d) {
      RankResult& result = results[d][tp.rank()];
      tp.stats().Reset();
      torch::Tensor x_leaf = Leaf(x, kDtypes[d]);
      torch::Tensor w1_shard = Leaf(w1.narrow(0, first, kLocal), kDtypes[d]);
      torch::Tensor w2_shard = Leaf(w2.narrow(1, first, kLocal), kDtypes[d]);
      torch::Tensor h = CopyToTensorParallelRegion(x_leaf, tp);
      torch::Tensor partial =
          torch::linear(torch::gelu(torch::linear(h, w1_shard)), w2_shard);
      torch::Tensor y = ReduceFromTensorParallelRegion(partial, tp);
      result.value = y.detach().clone();
      result.forward_all_reduces = tp.stats().Get(CommOp::kAllReduce).calls;
      result.forward_calls = tp.stats().TotalCalls();
      loss(y).backward();
      result.backward_calls = tp.stats().TotalCalls() - result.forward_calls;
      EXPECT_EQ(tp.stats().Get(CommOp::kAllReduce).calls, 2);
      result.grad = x_leaf.grad().clone();
      result.gathered_grads = {
          tp.AllGather(w1_shard.grad()).value(),
          tp.AllGather(w2_shard.grad().t().contiguous()).value().t()};
    }
  }));

  for (size_t d = 0; d < kDtypes.size(); ++d) {
    SCOPED_TRACE(c10::toString(kDtypes[d]));
    const double tolerance = Tolerance(kDtypes[d]);
    torch::Tensor x_ref = ReferenceLeaf(x, kDtypes[d]);
    torch::Tensor w1_ref = ReferenceLeaf(w1, kDtypes[d]);
    torch::Tensor w2_ref = ReferenceLeaf(w2, kDtypes[d]);
    torch::Tensor y_ref =
        torch::linear(torch::gelu(torch::linear(x_ref, w1_ref)), w2_ref);
    loss(y_ref).backward();
    for (int rank = 0; rank < kTp; ++rank) {
      const RankResult& result = results[d][rank];
      const std::string where = "rank " + std::to_string(rank);
      ExpectClose(result.value, y_ref, tolerance, "y " + where);
      ExpectClose(result.grad, x_ref.grad(), tolerance, "x grad " + where);
      ASSERT_EQ(result.gathered_grads.size(), 2u);
      ExpectClose(result.gathered_grads[0], w1_ref.grad(), tolerance,
                  "w1 grad " + where);
      ExpectClose(result.gathered_grads[1], w2_ref.grad(), tolerance,
                  "w2 grad " + where);
      // Reduce: one all-reduce forward; Copy: one all-reduce backward.
      EXPECT_EQ(result.forward_all_reduces, 1);
      EXPECT_EQ(result.forward_calls, 1);
      EXPECT_EQ(result.backward_calls, 1);
    }
  }
}

// Mixed precision: a float32 master gathered as bfloat16 gets its gradient
// summed in float32, at stage 3 (GatherShardedParameter) as at stage 1 with
// a tp sum (UseGatheredCopy's tp_sum). Rank 0's bfloat16 gradient is 1 and
// rank 1's 2^-8: each is exact in bfloat16, their sum 1 + 2^-8 is not
// (bfloat16 keeps 8 significant bits), so only a float32 sum keeps it.
TEST(ParallelOpsTest, MixedPrecisionGradientsSumAndLandInFloat32) {
  constexpr int kRanks = 2;
  constexpr int64_t kRows = 4;
  std::vector<torch::Tensor> gathered(kRanks), shard_grads(kRanks),
      whole_grads(kRanks);
  ExpectAllRanksOk(RunOnRanks(kRanks, [&](Communicator& group) {
    const double scale = group.rank() == 0 ? 1.0 : std::pow(2.0, -8);
    torch::Tensor shard =
        Leaf(torch::ones({kRows / kRanks, 3}), torch::kFloat32);
    torch::Tensor full =
        GatherShardedParameter(shard, kRows, group, torch::kBFloat16);
    gathered[group.rank()] = full.detach().clone();
    (full * scale).sum().backward();
    shard_grads[group.rank()] = shard.grad().clone();

    GatheredCopy copy;
    copy.whole_gradient = true;
    copy.value = torch::ones({kRows, 3}, torch::kBFloat16);
    torch::Tensor master =
        Leaf(torch::ones({kRows / kRanks, 3}), torch::kFloat32);
    (UseGatheredCopy(master, copy, group, /*tp_sum=*/&group) * scale)
        .sum()
        .backward();
    whole_grads[group.rank()] = copy.grad.clone();
  }));
  const double sum = 1.0 + std::pow(2.0, -8);
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(gathered[rank].scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(
        torch::equal(shard_grads[rank], torch::full({kRows / kRanks, 3}, sum)))
        << "rank " << rank << ": " << shard_grads[rank];
    EXPECT_TRUE(torch::equal(whole_grads[rank], torch::full({kRows, 3}, sum)))
        << "rank " << rank << ": " << whole_grads[rank];
  }
}

// A column-parallel linear whose weight is whole on every tp rank (LoRA's A)
// and whose output gradient is a partial sum over tp: with weight_tp_sum
// the weight's gradient is summed in float32 and rounded to bfloat16 once,
// as one rank rounds its whole product. Rank 0's partial is 1 + 3 * 2^-10
// (bfloat16 rounds it to 1), rank 1's 3 * 2^-10: rounding each before the
// sum gives 1 + 3 * 2^-10, one rounding of the sum 1 + 6 * 2^-10 gives
// 1 + 2^-7, on every rank.
TEST(ParallelOpsTest, ReplicatedColumnWeightGradientRoundsOnceAfterTheTpSum) {
  constexpr int kRanks = 2;
  std::vector<torch::Tensor> grads(kRanks), outputs(kRanks);
  ExpectAllRanksOk(RunOnRanks(kRanks, [&](Communicator& tp) {
    const double partial = std::ldexp(3.0, -10) + (tp.rank() == 0 ? 1.0 : 0.0);
    const torch::Tensor x = torch::ones({2, 3});  // float32 region input
    torch::Tensor w = Leaf(torch::ones({4, 3}), torch::kBFloat16);
    torch::Tensor u = ColumnParallelLinear(x, w, torch::kFloat32,
                                           /*bias=*/{}, &tp);
    outputs[tp.rank()] = u.detach().clone();
    // Each row's gradient is half the partial: the float32 sum over the two
    // rows restores it exactly.
    u.backward(torch::full({2, 4}, partial / 2, torch::kFloat32));
    grads[tp.rank()] = w.grad().clone();
  }));
  const torch::Tensor once =
      torch::full({4, 3}, 1.0 + std::ldexp(1.0, -7)).to(torch::kBFloat16);
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(outputs[rank].scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(outputs[rank], torch::full({2, 4}, 3.0)));
    EXPECT_TRUE(torch::equal(grads[rank], once))
        << "rank " << rank << ": " << grads[rank];
  }
}

// loss = sum(output) hands the backward an expanded (stride-0) gradient of
// ones; the reductions must still see every element. Each of the 3 ranks
// contributes ones, so the SUM is 3 wherever the rank's data is real.
TEST(ParallelOpsTest, ExpandedIncomingGradientsAreReduced) {
  constexpr int kRanks = 3;
  constexpr int64_t kRows = 7;  // shards of 3 rows; rank 2 holds 1 real row
  const torch::Tensor weight = Random({kRows, 2}, 60);
  std::vector<torch::Tensor> shard_grads(kRanks), input_grads(kRanks);
  ExpectAllRanksOk(RunOnRanks(kRanks, [&](Communicator& group) {
    torch::Tensor shard =
        Leaf(ShardDim0(weight, group.rank(), kRanks), torch::kFloat64);
    GatherShardedParameter(shard, kRows, group).sum().backward();
    shard_grads[group.rank()] = shard.grad().clone();

    torch::Tensor input = Leaf(weight, torch::kFloat64);
    CopyToTensorParallelRegion(input, group).sum().backward();
    input_grads[group.rank()] = input.grad().clone();
  }));
  for (int rank = 0; rank < kRanks; ++rank) {
    torch::Tensor expected_shard_grad = torch::zeros({3, 2}, torch::kFloat64);
    expected_shard_grad.narrow(0, 0, rank < 2 ? 3 : 1).fill_(kRanks);
    EXPECT_TRUE(torch::equal(shard_grads[rank], expected_shard_grad))
        << "rank " << rank << ": " << shard_grads[rank];
    EXPECT_TRUE(torch::equal(input_grads[rank],
                             torch::full({kRows, 2}, kRanks, torch::kFloat64)))
        << "rank " << rank << ": " << input_grads[rank];
  }
}

constexpr int64_t kVocab = 12;

// Every vocab id once (so every shard owns some targets), then `extra`.
torch::Tensor IdsCoveringVocab(std::vector<int64_t> extra) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < kVocab; ++i) ids.push_back((i * 5) % kVocab);
  ids.insert(ids.end(), extra.begin(), extra.end());
  return torch::tensor(ids, torch::kInt64);
}

TEST(ParallelOpsTest, VocabParallelEmbeddingMatchesEmbedding) {
  constexpr int64_t kDim = 5;
  const torch::Tensor ids = IdsCoveringVocab({0, 7, 11}).view({3, 5});
  const torch::Tensor weight = Random({kVocab, kDim}, 40);
  const torch::Tensor probe = Random({3, 5, kDim}, 41);
  auto loss = [&](const torch::Tensor& embedded) {
    return (embedded * probe.to(embedded.scalar_type())).sum();
  };

  for (int tp_size : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(tp_size));
    const int64_t rows = kVocab / tp_size;
    std::vector<std::vector<RankResult>> results(
        kDtypes.size(), std::vector<RankResult>(tp_size));
    ExpectAllRanksOk(RunOnRanks(tp_size, [&](Communicator& tp) {
      const int64_t vocab_start = tp.rank() * rows;
      for (size_t d = 0; d < kDtypes.size(); ++d) {
        RankResult& result = results[d][tp.rank()];
        tp.stats().Reset();
        torch::Tensor shard =
            Leaf(weight.narrow(0, vocab_start, rows), kDtypes[d]);
        torch::Tensor embedded =
            VocabParallelEmbedding(ids, shard, vocab_start, tp);
        result.value = embedded.detach().clone();
        result.forward_all_reduces = tp.stats().Get(CommOp::kAllReduce).calls;
        result.forward_calls = tp.stats().TotalCalls();
        loss(embedded).backward();
        result.backward_calls = tp.stats().TotalCalls() - result.forward_calls;
        result.grad = shard.grad().clone();
        result.gathered_grads = {tp.AllGather(shard.grad()).value()};
      }
    }));

    for (size_t d = 0; d < kDtypes.size(); ++d) {
      SCOPED_TRACE(c10::toString(kDtypes[d]));
      const double tolerance = Tolerance(kDtypes[d]);
      torch::Tensor weight_ref = ReferenceLeaf(weight, kDtypes[d]);
      torch::Tensor embedded_ref = torch::embedding(weight_ref, ids);
      loss(embedded_ref).backward();
      for (int rank = 0; rank < tp_size; ++rank) {
        const RankResult& result = results[d][rank];
        const std::string where = "rank " + std::to_string(rank);
        ExpectClose(result.value, embedded_ref, tolerance, "value " + where);
        ExpectClose(result.grad, weight_ref.grad().narrow(0, rank * rows, rows),
                    tolerance, "shard grad " + where);
        ASSERT_EQ(result.gathered_grads.size(), 1u);
        ExpectClose(result.gathered_grads[0], weight_ref.grad(), tolerance,
                    "gathered grad " + where);
        EXPECT_EQ(result.forward_all_reduces, 1);
        EXPECT_EQ(result.forward_calls, 1);
        EXPECT_EQ(result.backward_calls, 0);
      }
    }
  }
}

// The vocab-parallel cross-entropy equals log_softmax + gather on the full
// logits, including a row whose logits (~100) overflow exp() in fp32 unless
// the max is subtracted, and an empty batch.
TEST(ParallelOpsTest, VocabParallelTargetLogprobsMatchesLogSoftmax) {
  const torch::Tensor targets = IdsCoveringVocab({}).view({3, 4});
  torch::Tensor logits = Random({3, 4, kVocab}, 50) * 3;
  logits[0] += 100;
  const torch::Tensor weights = Random({3, 4}, 51);
  const int64_t positions = targets.numel();
  auto loss = [&](const torch::Tensor& logprobs) {
    return (logprobs * weights.to(logprobs.scalar_type())).sum();
  };

  for (int tp_size : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(tp_size));
    const int64_t columns = kVocab / tp_size;
    std::vector<std::vector<RankResult>> results(
        kDtypes.size(), std::vector<RankResult>(tp_size));
    std::vector<int64_t> empty_batch_sizes(tp_size, -1);
    ExpectAllRanksOk(RunOnRanks(tp_size, [&](Communicator& tp) {
      const int64_t vocab_start = tp.rank() * columns;
      for (size_t d = 0; d < kDtypes.size(); ++d) {
        RankResult& result = results[d][tp.rank()];
        tp.stats().Reset();
        torch::Tensor shard =
            Leaf(logits.narrow(-1, vocab_start, columns), kDtypes[d]);
        torch::Tensor logprobs =
            VocabParallelTargetLogprobs(shard, targets, vocab_start, tp);
        result.value = logprobs.detach().clone();
        result.forward_all_reduces = tp.stats().Get(CommOp::kAllReduce).calls;
        result.forward_all_reduce_bytes =
            tp.stats().Get(CommOp::kAllReduce).bytes;
        result.forward_calls = tp.stats().TotalCalls();
        loss(logprobs).backward();
        result.backward_calls = tp.stats().TotalCalls() - result.forward_calls;
        result.grad = shard.grad().clone();
        // Gather the vocab slices: move the vocab dim first for AllGather.
        result.gathered_grads = {
            tp.AllGather(shard.grad().movedim(-1, 0).contiguous())
                .value()
                .movedim(0, -1)};
      }
      torch::Tensor empty_shard =
          torch::zeros({0, columns}, torch::kFloat64).requires_grad_();
      torch::Tensor empty_logprobs = VocabParallelTargetLogprobs(
          empty_shard, torch::zeros({0}, torch::kInt64), vocab_start, tp);
      empty_logprobs.sum().backward();
      empty_batch_sizes[tp.rank()] = empty_logprobs.numel();
    }));

    for (size_t d = 0; d < kDtypes.size(); ++d) {
      SCOPED_TRACE(c10::toString(kDtypes[d]));
      const double tolerance = Tolerance(kDtypes[d]);
      torch::Tensor logits_ref = ReferenceLeaf(logits, kDtypes[d]);
      torch::Tensor logprobs_ref = torch::log_softmax(logits_ref, -1)
                                       .gather(-1, targets.unsqueeze(-1))
                                       .squeeze(-1);
      loss(logprobs_ref).backward();
      const int64_t element_bytes = kDtypes[d] == torch::kFloat64 ? 8 : 4;
      for (int rank = 0; rank < tp_size; ++rank) {
        const RankResult& result = results[d][rank];
        const std::string where = "rank " + std::to_string(rank);
        ExpectClose(result.value, logprobs_ref, tolerance, "value " + where);
        ExpectClose(result.grad,
                    logits_ref.grad().narrow(-1, rank * columns, columns),
                    tolerance, "shard grad " + where);
        ASSERT_EQ(result.gathered_grads.size(), 1u);
        ExpectClose(result.gathered_grads[0], logits_ref.grad(), tolerance,
                    "gathered grad " + where);
        // MAX of [positions], then SUM of the stacked [2, positions].
        EXPECT_EQ(result.forward_all_reduces, 2);
        EXPECT_EQ(result.forward_all_reduce_bytes,
                  3 * positions * element_bytes);
        EXPECT_EQ(result.forward_calls, 2);
        EXPECT_EQ(result.backward_calls, 0);
      }
    }
    EXPECT_EQ(empty_batch_sizes, std::vector<int64_t>(tp_size, 0));
  }
}

// Decoding's logits gather: the vocabulary slices of [B, T, V / tp] logits
// concatenated in tp rank order, the same bits on every rank, in one
// AllGather.
TEST(ParallelOpsTest, GatherVocabShardsRebuildsTheWholeLogits) {
  const torch::Tensor logits = Random({2, 3, kVocab}, 42);
  for (int tp_size : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(tp_size));
    const int64_t slice = kVocab / tp_size;
    std::vector<torch::Tensor> gathered(tp_size);
    std::vector<int64_t> calls(tp_size);
    ExpectAllRanksOk(RunOnRanks(tp_size, [&](Communicator& tp) {
      tp.stats().Reset();
      gathered[tp.rank()] =
          GatherVocabShards(logits.narrow(-1, tp.rank() * slice, slice), tp)
              .value();
      calls[tp.rank()] = tp.stats().Get(CommOp::kAllGather).calls;
    }));
    for (int rank = 0; rank < tp_size; ++rank) {
      EXPECT_TRUE(torch::equal(gathered[rank], logits)) << "rank " << rank;
      EXPECT_EQ(calls[rank], 1) << "rank " << rank;
    }
  }
}

TEST(ParallelOpsTest, RejectsInconsistentArgumentsNamingThem) {
  using ::testing::HasSubstr;
  std::unique_ptr<Communicator> single = MakeSingleRankCommunicator().value();
  auto message = [](const absl::Status& status) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
    return std::string(status.message());
  };
  const torch::Tensor three_rows = torch::zeros({3, 2}, torch::kFloat64);
  EXPECT_THAT(
      message(CatchTorch(
          "gather", [&] { GatherShardedParameter(three_rows, 2, *single); })),
      HasSubstr("full_dim0 2"));

  const torch::Tensor logits = torch::zeros({2, kVocab}, torch::kFloat64);
  const torch::Tensor out_of_vocab =
      torch::tensor(std::vector<int64_t>{0, kVocab}, torch::kInt64);
  EXPECT_THAT(message(CatchTorch("logprobs",
                                 [&] {
                                   VocabParallelTargetLogprobs(
                                       logits, out_of_vocab, 0, *single);
                                 })),
              HasSubstr("targets must lie in [0, 12)"));
  EXPECT_THAT(message(CatchTorch("logprobs",
                                 [&] {
                                   VocabParallelTargetLogprobs(
                                       logits, out_of_vocab.to(torch::kInt32),
                                       0, *single);
                                 })),
              HasSubstr("targets must be int64"));
  EXPECT_THAT(message(CatchTorch("embedding",
                                 [&] {
                                   VocabParallelEmbedding(
                                       torch::zeros({1}, torch::kInt64),
                                       torch::zeros({kVocab}, torch::kFloat64),
                                       0, *single);
                                 })),
              HasSubstr("weight_shard must be [rows, D]"));
  // None of the rejected calls reached a collective.
  EXPECT_EQ(single->stats().TotalCalls(), 0);
}

}  // namespace
}  // namespace tally
