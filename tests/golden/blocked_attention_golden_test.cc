// Golden tests of blocked attention (runtime/model/blocked_attention.h) on a
// mesh: a model trained on a multi-rank engine whose attention goes by blocks
// of 3 keys (EngineOptions::attention kBlocked: many blocks, most calls with a
// partial last one) equals the same model trained on a single device with
// the materialized [T, K] softmax. Real rank processes on loopback each run
// the mesh engine and, in the same process, the single-rank reference on the
// same samples (as multirank_golden_test.cc): per-call and per-sample losses
// and logprobs, every gradient shard, the norm and clip coefficient, and
// every parameter after two windows (as this rank's shard and gathered
// whole), in fp64 at 1e-10 relative, under TOKEN_MEAN and SUM. The meshes:
// cp2 x tp2 (context parallelism: each rank's queries two load-balanced
// chunks, its keys the cp group's, gathered in rank order, so blocks mix
// chunks and padding), dp_shard2 x tp2 (whole right-padded samples), and cp2
// with sliding-window families: mistral (a window of 3 on every layer, one
// model recomputing its layers in backward) and qwen2 (a full first layer, a
// windowed second). dp_shard2 x tp2 also runs mistral, whose padding queries
// past a short sample's window see no key at all (blocked: zeros; the
// materialized mask falls back to the causal keys): neither may touch a loss
// or a gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/engine/engine.h"
#include "runtime/model/attention_layout.h"
#include "runtime/parallel/distributed.h"
#include "runtime/train/context_parallel.h"
#include "runtime/train/loss.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/golden.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::MakeSample;
using testing::MakeSamples;
using testing::RelativeDiff;

constexpr double kTol = 1e-10;     // testing::GoldenTolerance(kFloat64)
constexpr int64_t kBlockKeys = 3;  // the mesh engine's keys per block
constexpr int64_t kWindow = 3;     // the sliding-window families' window

// One model trained on both engines.
struct Variant {
  const char* family;  // nullptr: llama; "mistral" or "qwen2": windowed
  LossReduction reduction;
  bool recompute = false;  // the mesh's model recomputes its layers
};

struct MeshCase {
  const char* name;
  MeshShape shape;
  std::vector<Variant> variants;
};

MeshShape Shape(int dp_shard, int tp, int cp) {
  MeshShape shape;
  shape.dp_shard = dp_shard;
  shape.tp = tp;
  shape.cp = cp;
  return shape;
}

// gtest's name for a failing case's parameter.
void PrintTo(const MeshCase& mesh_case, std::ostream* os) {
  *os << mesh_case.name;
}

std::string MeshName(const ::testing::TestParamInfo<MeshCase>& info) {
  return info.param.name;
}

std::string VariantName(const Variant& v) {
  return absl::StrCat(v.family == nullptr ? "llama" : v.family, "_",
                      ReductionName(v.reduction),
                      v.recompute ? "_recompute" : "");
}

// TinyConfig (hidden 32, 4 heads of 8, 2 kv heads: tp 2 divides every
// split), fp64, AdamW with weight decay; the windowed families with a
// window of kWindow (qwen2: on the second layer only).
ModelSpec Spec(const std::string& id, const Variant& v) {
  ModelSpec spec =
      testing::TinySpec(id, DType::kFloat64, OptimizerKind::kAdamW);
  if (v.family == nullptr) return spec;
  spec.config.model_type = v.family;
  spec.config.sliding_window = kWindow;
  if (spec.config.model_type == "qwen2") spec.config.max_window_layers = 1;
  return spec;
}

// Two windows of two calls of samples of uneven lengths, most longer than
// the window, batched into micro-batches of at most kMaxBatchTokens padded
// tokens. The first call holds one 2-token sample with one valid token (a
// data rank of dp_shard 2 runs an empty micro-batch); the second mixes
// samples of 22, 6, 4 (fully ignored) and 7 tokens, a 13-token one whose
// valid targets sit unevenly over the cp chunks, and samples of 1 and 3
// tokens (empty chunks at cp 2); window 1 holds a 33-token sample (alone in
// its micro-batch: 34 gathered keys, 12 blocks, under cp 2) among short
// ones. WindowsReachEveryBlockCase below checks what these reach.
std::vector<std::vector<std::vector<Sample>>> Windows() {
  const int64_t vocab = testing::TinyConfig().vocab_size;
  std::vector<Sample> mixed = MakeSamples(vocab, {20, 3, 0, 7}, 52);
  mixed.push_back(
      testing::MakeSampleValidAt(vocab, 13, {0, 1, 2, 6, 7, 11}, 54));
  mixed.push_back(MakeSample(vocab, 1, 1, 55));
  mixed.push_back(MakeSample(vocab, 3, 2, 56));
  return {{MakeSamples(vocab, {1}, 51), mixed},
          {MakeSamples(vocab, {30, 2, 9, 1}, 53),
           MakeSamples(vocab, {5, 11, 0, 2}, 57)}};
}

// Window 0 does not clip; window 1 clips hard.
OptimStepArgs WindowStep(int window) {
  OptimStepArgs args;
  args.max_grad_norm = window == 0 ? 0.0 : 1e-3;
  return args;
}

constexpr int64_t kMaxBatchTokens = 40;

EngineOptions Options(AttentionMode mode) {
  EngineOptions options;
  options.max_batch_tokens = kMaxBatchTokens;
  options.attention.mode = mode;
  options.attention.block_keys = kBlockKeys;
  return options;
}

// Every parameter's shard on this rank against the reference's `full`
// tensors; gathered whole as well when `gather`.
absl::Status ExpectSameParameters(CausalLm& model, CausalLm& ref_model,
                                  bool gather) {
  for (const Parameter& p : model.parameters()) {
    const Parameter* ref = ref_model.Find(p.name);
    if (ref == nullptr) {
      ADD_FAILURE() << p.name << " missing from the reference";
      continue;
    }
    EXPECT_LT(RelativeDiff(p.tensor, model.LocalShard(p, ref->tensor)), kTol)
        << p.name;
    if (!gather) continue;
    TALLY_ASSIGN_OR_RETURN(torch::Tensor full, model.GatherFull(p, p.tensor));
    EXPECT_EQ(full.sizes(), ref->tensor.sizes()) << p.name;
    if (full.sizes() == ref->tensor.sizes()) {
      EXPECT_LT(RelativeDiff(full, ref->tensor), kTol) << p.name;
    }
  }
  return absl::OkStatus();
}

// One variant trained for Windows() on this rank's `engine` and on the
// single-device `reference`; every rank checks its shards.
absl::Status CheckVariant(Engine& engine, Engine& reference, const Variant& v) {
  const std::string id = VariantName(v);
  SCOPED_TRACE(id);
  ModelSpec spec = Spec(id, v);
  TALLY_RETURN_IF_ERROR(reference.CreateModel(spec).status());
  spec.activation_checkpointing = v.recompute;
  TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
  CausalLm& model = *EngineTestPeer::Model(engine, id).value();
  CausalLm& ref_model = *EngineTestPeer::Model(reference, id).value();
  // The engines' attention options reached the models.
  EXPECT_EQ(model.attention().mode, AttentionMode::kBlocked);
  EXPECT_EQ(model.attention().block_keys, kBlockKeys);
  EXPECT_EQ(ref_model.attention().mode, AttentionMode::kMaterialized);
  EXPECT_EQ(model.recompute_layers(), v.recompute);
  // The same initial weights, bitwise.
  for (const Parameter& p : model.parameters()) {
    EXPECT_TRUE(torch::equal(
        p.tensor, model.LocalShard(p, ref_model.Find(p.name)->tensor)))
        << p.name;
  }

  const auto windows = Windows();
  for (size_t w = 0; w < windows.size(); ++w) {
    SCOPED_TRACE(absl::StrCat("window ", w));
    for (size_t c = 0; c < windows[w].size(); ++c) {
      SCOPED_TRACE(absl::StrCat("call ", c));
      const std::vector<Sample>& call = windows[w][c];
      ForwardBackwardArgs args{call, v.reduction};
      args.return_logprobs = true;
      TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult got,
                             engine.ForwardBackward(id, args));
      TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult want,
                             reference.ForwardBackward(id, args));
      testing::ExpectSameCall(got, want, kTol);
      EXPECT_EQ(got.samples.size(), call.size());
      for (size_t i = 0; i < std::min(got.samples.size(), call.size()); ++i) {
        EXPECT_EQ(got.samples[i].logprobs.size(), call[i].input_tokens.size())
            << "sample " << i;
      }
    }
    // EAGER: summed over the replicas (cp) and reduce-scattered over
    // dp_shard after every call: this rank's gradient shard is the single
    // device's.
    testing::ExpectGradientShards(model, ref_model, kTol);

    const OptimStepArgs step = WindowStep(static_cast<int>(w));
    TALLY_ASSIGN_OR_RETURN(OptimStepResult got, engine.OptimStep(id, step));
    TALLY_ASSIGN_OR_RETURN(OptimStepResult want, reference.OptimStep(id, step));
    testing::ExpectSameStep(got, want, step, kTol);
    // The norm is the same bits on every rank.
    torch::Tensor norm = torch::tensor({got.grad_norm}, torch::kFloat64);
    TALLY_ASSIGN_OR_RETURN(torch::Tensor norms, engine.world().AllGather(norm));
    for (int r = 0; r < norms.size(0); ++r) {
      EXPECT_EQ(norms[r].item<double>(), got.grad_norm) << "rank " << r;
    }
    TALLY_RETURN_IF_ERROR(ExpectSameParameters(
        model, ref_model, /*gather=*/w + 1 == windows.size()));
  }
  return absl::OkStatus();
}

class BlockedAttentionGoldenTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(BlockedAttentionGoldenTest, EqualsTheMaterializedSingleDeviceRun) {
  const MeshCase& mesh_case = GetParam();
  testing::RunGoldenOnRanks(
      mesh_case.shape, Options(AttentionMode::kBlocked),
      Options(AttentionMode::kMaterialized),
      [&](Engine& engine, Engine& reference, const RankEnv&) -> absl::Status {
        for (const Variant& v : mesh_case.variants) {
          TALLY_RETURN_IF_ERROR(CheckVariant(engine, reference, v));
        }
        return absl::OkStatus();
      });
}

constexpr LossReduction kTokenMean = LossReduction::kTokenMean;
constexpr LossReduction kSum = LossReduction::kSum;

INSTANTIATE_TEST_SUITE_P(
    Meshes, BlockedAttentionGoldenTest,
    ::testing::Values(
        MeshCase{"cp2_tp2",
                 Shape(1, 2, 2),
                 {{nullptr, kTokenMean}, {nullptr, kSum}}},
        MeshCase{"dp_shard2_tp2",
                 Shape(2, 2, 1),
                 {{nullptr, kTokenMean}, {nullptr, kSum}, {"mistral", kSum}}},
        MeshCase{"cp2_sliding_window",
                 Shape(1, 1, 2),
                 {{"mistral", kTokenMean},
                  {"mistral", kSum, /*recompute=*/true},
                  {"qwen2", kTokenMean}}}),
    MeshName);

// The queries of `layout` that see no key under `window` (0: causal only).
int64_t BlindQueries(const AttentionLayout& layout, int64_t window) {
  const torch::Tensor distance =
      layout.positions.unsqueeze(2) - layout.key_positions.unsqueeze(1);
  torch::Tensor visible = layout.key_valid.unsqueeze(1) & (distance >= 0);
  if (window > 0) visible = visible & (distance < window);
  return (~visible.any(-1)).sum().item<int64_t>();
}

// Windows() reaches every case of the blocked path on the meshes above, as
// the engine plans the calls (PartitionSamples, PlanBatches, PackRows and
// SplitForContextParallel): right-padded rows, padding queries that see no
// key in the window (dp_shard 2), and under cp 2 gathered keys of many
// blocks with a partial last one and ranks without a chunk of a sample.
TEST(BlockedAttentionGoldenPlanTest, WindowsReachEveryBlockCase) {
  int64_t padded_rows = 0, blind = 0, partial = 0, max_keys = 0, empty = 0;
  for (const auto& window : Windows()) {
    for (const std::vector<Sample>& call : window) {
      // dp_shard 2: whole samples per data rank.
      for (const std::vector<int>& part : PartitionSamples(call, 2)) {
        for (const std::vector<int>& rows :
             PlanBatches(call, part, kMaxBatchTokens)) {
          const PackedBatch batch = PackRows(call, rows, torch::kFloat64);
          const int64_t seq = batch.inputs.size(1);
          for (int64_t length : batch.lengths) padded_rows += length < seq;
          blind += BlindQueries(
              AttentionLayout::RightPadded(batch.lengths, seq), kWindow);
        }
      }
      // cp 2: every sample on the one data rank, split over the cp ranks.
      std::vector<int> all(call.size());
      for (size_t i = 0; i < call.size(); ++i) all[i] = static_cast<int>(i);
      for (const std::vector<int>& rows :
           PlanBatches(call, all, kMaxBatchTokens)) {
        const PackedBatch batch = PackRows(call, rows, torch::kFloat64);
        for (int rank = 0; rank < 2; ++rank) {
          const ContextParallelBatch split =
              SplitForContextParallel(batch, rank, 2);
          const int64_t keys = split.layout.key_positions.size(1);
          max_keys = std::max(max_keys, keys);
          partial += keys > kBlockKeys && keys % kBlockKeys != 0;
          for (int64_t length : split.local.lengths) empty += length == 0;
          // A context-parallel padding query sits at its sample's length:
          // it always sees the sample's last key.
          EXPECT_EQ(BlindQueries(split.layout, kWindow), 0);
        }
      }
    }
  }
  EXPECT_GT(padded_rows, 0);
  EXPECT_GT(blind, 0);
  EXPECT_GT(partial, 0);
  EXPECT_GE(max_keys, 10 * kBlockKeys);
  EXPECT_GT(empty, 0);
}

}  // namespace
}  // namespace tally
