// Blocked attention (runtime/model/blocked_attention.h) against the textbook
// masked softmax(q kᵀ / √d) v materialized whole, in fp64: outputs and the
// gradients of q, k and v on every query that sees a key, for causal,
// sliding-window, padded and context-parallel layouts and every block size;
// then whole models trained with it against the materialized path.
#include "runtime/model/blocked_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "runtime/config/memory_estimate.h"
#include "runtime/engine/engine.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::MakeSamples;
using testing::RelativeDiff;

// The definition: scores over every key, hidden ones at -inf, softmax, v.
torch::Tensor ReferenceAttention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v,
                                 const AttentionLayout& layout,
                                 int64_t window) {
  const torch::Tensor distance =
      layout.positions.unsqueeze(2) - layout.key_positions.unsqueeze(1);
  torch::Tensor visible = layout.key_valid.unsqueeze(1) & (distance >= 0);
  if (window > 0) visible = visible & (distance < window);
  // A query that sees nothing (padding past a window) would be NaN, and its
  // NaN would reach every gradient through the softmax's backward even
  // though the test masks its output: it sees every key here instead.
  visible = visible | ~visible.any(-1, /*keepdim=*/true);
  const torch::Tensor scores =
      (torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(q.size(-1)))
          .masked_fill(~visible.unsqueeze(1),
                       -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
}

struct Case {
  const char* name;
  AttentionLayout layout;
  int64_t window = 0;
};

// Queries at `positions` of their sample, keys at `key_positions`, the
// keys at or past `lengths[b]` padding.
AttentionLayout Layout(const std::vector<std::vector<int64_t>>& positions,
                       const std::vector<std::vector<int64_t>>& key_positions,
                       const std::vector<int64_t>& lengths) {
  AttentionLayout layout;
  std::vector<torch::Tensor> rows, key_rows, valid;
  for (size_t b = 0; b < positions.size(); ++b) {
    rows.push_back(torch::tensor(positions[b], torch::kInt64));
    key_rows.push_back(torch::tensor(key_positions[b], torch::kInt64));
    valid.push_back(key_rows.back() < lengths[b]);
  }
  layout.positions = torch::stack(rows);
  layout.key_positions = torch::stack(key_rows);
  layout.key_valid = torch::stack(valid);
  return layout;
}

std::vector<Case> Cases() {
  std::vector<int64_t> all(13);
  for (int64_t i = 0; i < 13; ++i) all[i] = i;
  // Context parallelism's load-balanced chunks: this rank's queries are
  // chunks 1 and 2 of 4 (positions 3..8 of 12), its keys every rank's, in
  // rank order (chunks 0, 3, 1, 2).
  const std::vector<int64_t> cp_queries = {3, 4, 5, 6, 7, 8};
  const std::vector<int64_t> cp_keys = {0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8};
  return {
      {"causal_padded", AttentionLayout::RightPadded({13, 9}, 13)},
      {"sliding_window", AttentionLayout::RightPadded({13, 7}, 13), 4},
      {"context_parallel",
       Layout({cp_queries, cp_queries}, {cp_keys, cp_keys}, {12, 7})},
      {"context_parallel_window",
       Layout({cp_queries, cp_queries}, {cp_keys, cp_keys}, {12, 10}), 3},
      {"unpadded", Layout({all}, {all}, {13})},
  };
}

class BlockedAttentionTest
    : public ::testing::TestWithParam<std::tuple<Case, int64_t>> {};

TEST_P(BlockedAttentionTest, EqualsTheMaterializedSoftmax) {
  const auto& [c, block] = GetParam();
  torch::manual_seed(7);
  const int64_t batch = c.layout.positions.size(0);
  const int64_t seq = c.layout.positions.size(1);
  const int64_t keys = c.layout.key_positions.size(1);
  auto input = [&](int64_t length) {
    return torch::randn({batch, 3, length, 8}, torch::kFloat64)
        .requires_grad_(true);
  };
  const torch::Tensor q = input(seq), k = input(keys), v = input(keys);
  const torch::Tensor out_grad =
      torch::randn({batch, 3, seq, 8}, torch::kFloat64);
  // Only queries that see a key count: a padding query seeing none is
  // zeros here and undefined in the definition.
  const torch::Tensor distance =
      c.layout.positions.unsqueeze(2) - c.layout.key_positions.unsqueeze(1);
  torch::Tensor visible = c.layout.key_valid.unsqueeze(1) & (distance >= 0);
  if (c.window > 0) visible = visible & (distance < c.window);
  const torch::Tensor seeing =
      visible.any(-1).unsqueeze(1).unsqueeze(-1).expand({batch, 3, seq, 8});

  std::vector<torch::Tensor> results;
  for (bool blocked : {false, true}) {
    for (const torch::Tensor& t : {q, k, v}) t.mutable_grad() = torch::Tensor();
    torch::Tensor out =
        blocked ? BlockedAttention(q, k, v, c.layout, c.window, block)
                : ReferenceAttention(q, k, v, c.layout, c.window);
    out = out.masked_fill(~seeing, 0.0);
    (out * out_grad).sum().backward();
    results.push_back(out.detach());
    for (const torch::Tensor& t : {q, k, v}) results.push_back(t.grad());
  }
  const char* names[] = {"output", "dq", "dk", "dv"};
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(results[4 + i].isfinite().all().item<bool>()) << names[i];
    EXPECT_LT(RelativeDiff(results[4 + i], results[i]), 1e-13) << names[i];
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, BlockedAttentionTest,
                         ::testing::Combine(::testing::ValuesIn(Cases()),
                                            ::testing::Values(1, 4, 5, 64)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) +
                                  "_block" +
                                  std::to_string(std::get<1>(info.param));
                         });

// A single-rank engine computing attention by `mode`, in blocks of 3 keys.
std::unique_ptr<Engine> EngineWith(AttentionMode mode) {
  EngineOptions options;
  options.attention.mode = mode;
  options.attention.block_keys = 3;
  return Engine::CreateSingleRank(options).value();
}

// Two engines, one per attention path, train the same model for two
// windows: losses, norms and parameters agree at the fp64 golden tolerance.
void ExpectSameTraining(ModelSpec spec, bool recompute) {
  spec.activation_checkpointing = recompute;
  std::vector<std::vector<double>> runs;
  std::vector<std::vector<torch::Tensor>> parameters;
  for (AttentionMode mode :
       {AttentionMode::kMaterialized, AttentionMode::kBlocked}) {
    std::unique_ptr<Engine> engine = EngineWith(mode);
    ASSERT_TRUE(engine->CreateModel(spec).ok());
    std::vector<double>& run = runs.emplace_back();
    for (uint64_t window = 0; window < 2; ++window) {
      ForwardBackwardArgs args{MakeSamples(48, {9, 4, 6}, 31 + window)};
      run.push_back(engine->ForwardBackward("m", args).value().loss_sum);
      run.push_back(engine->OptimStep("m", {}).value().grad_norm);
    }
    std::vector<torch::Tensor>& params = parameters.emplace_back();
    for (const Parameter& p :
         EngineTestPeer::Model(*engine, "m").value()->parameters()) {
      params.push_back(p.tensor.detach().clone());
    }
  }
  for (size_t i = 0; i < runs[0].size(); ++i) {
    EXPECT_LT(RelativeDiff(runs[1][i], runs[0][i]), 1e-10) << i;
  }
  for (size_t i = 0; i < parameters[0].size(); ++i) {
    EXPECT_LT(RelativeDiff(parameters[1][i], parameters[0][i]), 1e-10) << i;
  }
}

TEST(BlockedAttentionModelTest, TrainsLikeTheMaterializedPath) {
  ExpectSameTraining(
      testing::TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW), false);
}

TEST(BlockedAttentionModelTest, SlidingWindowAndRecomputedLayers) {
  ModelSpec spec =
      testing::TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW);
  spec.config.model_type = "mistral";
  spec.config.sliding_window = 3;
  ExpectSameTraining(spec, /*recompute=*/true);
}

// Mixed precision: both paths run bfloat16 matmuls with float32 softmax
// statistics, but the blocked one rounds each block's partial products, so
// the two are close (a few bfloat16 roundings), not equal.
TEST(BlockedAttentionModelTest, MixedPrecisionStaysCloseToTheMaterializedPath) {
  const ModelSpec spec =
      testing::TinySpec("m", DType::kBFloat16, OptimizerKind::kAdamW);
  std::vector<ForwardBackwardResult> calls;
  std::vector<double> norms;
  for (AttentionMode mode :
       {AttentionMode::kMaterialized, AttentionMode::kBlocked}) {
    std::unique_ptr<Engine> engine = EngineWith(mode);
    ASSERT_TRUE(engine->CreateModel(spec).ok());
    calls.push_back(
        engine->ForwardBackward("m", {MakeSamples(48, {9, 4, 6}, 31)}).value());
    norms.push_back(engine->OptimStep("m", {}).value().grad_norm);
  }
  EXPECT_LT(RelativeDiff(calls[1].loss_sum, calls[0].loss_sum), 1e-2);
  EXPECT_LT(RelativeDiff(norms[1], norms[0]), 5e-2);
  EXPECT_TRUE(std::isfinite(norms[1]));
}

TEST(BlockedAttentionModelTest, AutoGoesByBlocksPastItsLength) {
  AttentionOptions options;
  EXPECT_FALSE(options.Blocked(AttentionOptions::kAutoFromKeys));
  EXPECT_TRUE(options.Blocked(AttentionOptions::kAutoFromKeys + 1));
  options.mode = AttentionMode::kMaterialized;
  EXPECT_FALSE(options.Blocked(1 << 20));
  options.mode = AttentionMode::kBlocked;
  EXPECT_TRUE(options.Blocked(1));
  // Admission's activation bound follows: at 16k tokens the scores are
  // most of the materialized estimate and a sliver of the blocked one.
  const LlamaConfig config = testing::TinyConfig();
  auto bytes = [&](AttentionMode mode, const std::vector<int64_t>& lengths) {
    AttentionOptions attention;
    attention.mode = mode;
    return CallActivationBytes(config, DType::kFloat32, lengths, 16384,
                               attention);
  };
  const std::vector<int64_t> long_sample = {16384};
  EXPECT_LT(bytes(AttentionMode::kBlocked, long_sample) * 20,
            bytes(AttentionMode::kMaterialized, long_sample));
  // kAuto: a call may also hold a micro-batch of 2048-token samples, which
  // stays materialized; the bound covers it.
  EXPECT_GE(bytes(AttentionMode::kAuto, long_sample),
            bytes(AttentionMode::kMaterialized,
                  std::vector<int64_t>(8, AttentionOptions::kAutoFromKeys)));
  EXPECT_LT(bytes(AttentionMode::kAuto, long_sample),
            bytes(AttentionMode::kMaterialized, long_sample));
}

}  // namespace
}  // namespace tally
