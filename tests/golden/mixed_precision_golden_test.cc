// The bf16 golden contract on meshes (docs/distributed.md, "bf16
// reductions"): a bfloat16 mixed-precision model trained on a mesh is no
// further from the single device's float32 model than the single device's
// own bfloat16 model is, and every ZeRO stage gives the same numbers. Real
// rank processes on loopback each run the mesh engine and, in the same
// process, a single-rank reference holding the bf16 and float32 models of
// the same seed. For full (qwen3: q/k norms, tp-replicated weights read in
// the tp region) and LoRA models, SGD and AdamW, three seeds: two windows,
// each measured after its calls (the gradients) and after its step (the
// parameters), and with AdamW a third window's gradients from a state the
// bf16 models take from the float32 one (below). The distances are relative L2
// over the trainable values, each rank adding the ones it holds and the terms
// summed over the world: mesh bf16 to single float32 against single bf16 to
// single float32.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "kernels/onednn_matmul.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/communicator.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/golden.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::MakeSamples;
using testing::RelativeDiff;

// How much further from float32 than the single device a mesh may be, per
// mesh and optimizer (the distances summed over the ranks). dp_shard: every
// reduction sums float32 and lands in the float32 master, so the mesh
// rounds no more than one rank: 0.975x to 1.014x over seeds 11-13 (up to
// 1.04x when stages 2 and 3 rounded their reduce-scatters to bfloat16).
// tp: the tensor-parallel linears keep their partial sums in float32 and
// round each tp sum once, the column-parallel bias and LoRA A's gradient
// included (ColumnParallelLinear, RowParallelLinear), so with SGD the mesh
// is as close as one rank: 0.97x to 1.016x full, 0.88x to 0.95x LoRA over
// seeds 11-13 (before, each partial was rounded by its matmul: up to 1.24x
// full and 1.52x LoRA). These two bounds hold for the seeds tested, without
// margin beyond them: seeds 14-17 reach 1.030x (tp2 and dp_shard2 x tp2,
// full, seed 14's second window, with LibTorch's own linears too) and, on
// dp_shard2, 1.054x (LoRA, SGD, seed 15's second window; 1.093x there
// after an AdamW step).
//
// AdamW's first step moves each element by about +-lr whatever its
// gradient's size, so after it the distances mostly count sign flips of
// tiny gradient elements, on the mesh as on one rank, and the parameters
// and the next window's gradients (taken at those parameters) spread on
// both sides of 1 (tp2, seeds 11-17: 0.91x to 1.20x full, 0.24x to 1.22x
// LoRA): kTensorParallelAdamWSlack bounds that trajectory loosely. The
// update is the same elementwise float32 code on the mesh and on one rank;
// what the mesh computes differently is the gradient. So AdamW's tight
// bound is on gradients without flips in them: window 0's (from the
// initial state) and, after the two steps, a third window's from a state
// every bfloat16 model takes from the float32 model (its masters and
// moments, through a checkpoint): tp2 and dp_shard2 x tp2, seeds 11-17,
// 0.97x to 1.016x full, 0.89x to 0.95x LoRA.
constexpr double kDataParallelSlack = 0.03;
constexpr double kTensorParallelSgdSlack = 0.03;
constexpr double kTensorParallelAdamWSlack = 0.3;
constexpr double kTensorParallelSharedStateSlack = 0.05;
// A build without the bf16 -> float32 matmul (kernels/onednn_matmul.h: a
// LibTorch other than Debian's) rounds each tp partial by its matmul, as
// before: up to 1.24x full and 1.52x LoRA.
constexpr double kTensorParallelRoundedSlack = 0.6;
// ZeRO stages 1, 2 and 3 reduce the same float32 values; only the order of
// float32 additions differs (a window's passes summed before or after the
// reduction), far below bfloat16's rounding (4e-3).
constexpr double kStageTolerance = 1e-5;

struct MeshCase {
  const char* name;
  MeshShape shape;
  // The mesh's contract slack (above), per optimizer, and for AdamW's
  // gradients from a shared state.
  double sgd_slack;
  double adamw_slack;
  double shared_slack;
};

MeshShape Shape(int dp_shard, int tp) {
  MeshShape shape;
  shape.dp_shard = dp_shard;
  shape.tp = tp;
  return shape;
}

std::string MeshName(const ::testing::TestParamInfo<MeshCase>& info) {
  return info.param.name;
}

struct Variant {
  bool lora;
  OptimizerKind optimizer;
  uint64_t seed;
};

std::string VariantName(const Variant& v) {
  return absl::StrCat(v.lora ? "lora" : "full", "/", OptimizerName(v.optimizer),
                      "/seed", v.seed);
}

ModelSpec VariantSpec(const Variant& v, const std::string& id, DType dtype) {
  ModelSpec spec = testing::TinySpec(id, dtype, v.optimizer, v.seed);
  spec.config.model_type = "qwen3";
  spec.grad_sync = GradSync::kEager;  // each call's sum lands in .grad
  spec.default_adam.learning_rate = 1e-2;
  if (v.lora) {
    spec.lora.rank = 4;
    spec.lora.alpha = 8;
  }
  return spec;
}

// Three windows of two calls, seeded by the variant: two stepped, then
// (AdamW) one measured from a shared state.
std::vector<std::vector<std::vector<Sample>>> Windows(uint64_t seed) {
  const int64_t vocab = testing::TinyConfig().vocab_size;
  return {{MakeSamples(vocab, {24, 9, 17}, seed),
           MakeSamples(vocab, {31, 5}, seed + 1)},
          {MakeSamples(vocab, {12, 28}, seed + 2),
           MakeSamples(vocab, {19, 7, 22}, seed + 3)},
          {MakeSamples(vocab, {27, 11}, seed + 4),
           MakeSamples(vocab, {8, 30, 14}, seed + 5)}};
}

// ||got - want|| / ||want|| accumulated over tensors.
struct L2Distance {
  double diff = 0;
  double norm = 0;
  void Add(const torch::Tensor& got, const torch::Tensor& want) {
    const torch::Tensor w = want.to(torch::kFloat64);
    diff += (got.to(torch::kFloat64) - w).pow(2).sum().item<double>();
    norm += w.pow(2).sum().item<double>();
  }
  double value() const { return norm > 0 ? std::sqrt(diff / norm) : 0; }
};

// What one measurement compares: the gradients or the parameter values.
torch::Tensor Value(const Parameter& p, bool gradients) {
  return gradients ? p.tensor.grad() : p.tensor.detach();
}

// One measurement: every ZeRO stage's model against the single float32
// model, the single bf16 one likewise (the distances summed over the world:
// each rank adds the values it holds), and the stages against each other.
absl::Status Measure(const std::vector<CausalLm*>& stages, CausalLm& one_bf16,
                     CausalLm& one_f32, bool gradients, Communicator& world,
                     double slack, const std::string& what) {
  SCOPED_TRACE(what);
  L2Distance one;
  std::vector<L2Distance> mesh(stages.size());
  for (const Parameter& p : stages[0]->parameters()) {
    if (!p.trainable) continue;
    const Parameter* bf16 = one_bf16.Find(p.name);
    const Parameter* f32 = one_f32.Find(p.name);
    if (bf16 == nullptr || f32 == nullptr) {
      return absl::NotFoundError(p.name + " missing from the reference");
    }
    const torch::Tensor want = stages[0]->LocalShard(p, Value(*f32, gradients));
    one.Add(stages[0]->LocalShard(p, Value(*bf16, gradients)), want);
    for (size_t s = 0; s < stages.size(); ++s) {
      const Parameter* q = stages[s]->Find(p.name);
      if (q == nullptr) return absl::NotFoundError(p.name + " missing");
      mesh[s].Add(Value(*q, gradients), want);
      EXPECT_LT(RelativeDiff(Value(*q, gradients), Value(p, gradients)),
                kStageTolerance)
          << p.name << ": stage of model " << s << " against model 0";
    }
  }
  std::vector<double> terms = {one.diff, one.norm};
  for (const L2Distance& d : mesh) {
    terms.push_back(d.diff);
    terms.push_back(d.norm);
  }
  torch::Tensor sums = torch::tensor(terms, torch::kFloat64);
  TALLY_RETURN_IF_ERROR(world.AllReduce(sums, ReduceOp::kSum));
  one = {sums[0].item<double>(), sums[1].item<double>()};
  EXPECT_GT(one.value(), 0) << "bf16 computed in float32?";
  for (size_t s = 0; s < stages.size(); ++s) {
    mesh[s] = {sums[2 + 2 * s].item<double>(), sums[3 + 2 * s].item<double>()};
    EXPECT_LE(mesh[s].value(), one.value() * (1 + slack))
        << "model " << s << ": mesh bf16 to float32 " << mesh[s].value()
        << ", single bf16 to float32 " << one.value();
  }
  return absl::OkStatus();
}

// Every bfloat16 model (the mesh's, the single device's) continues from the
// single float32 model's state: its float32 masters and optimizer moments,
// saved by this rank's reference in `dir` and loaded as they are.
absl::Status ContinueFromFloat32(Engine& engine, Engine& reference,
                                 const std::vector<std::string>& ids,
                                 const std::string& dir) {
  TALLY_RETURN_IF_ERROR(reference.SaveCheckpoint("f32", dir).status());
  TALLY_RETURN_IF_ERROR(
      reference.LoadCheckpoint("bf16", dir, /*load_optimizer=*/true).status());
  for (const std::string& id : ids) {
    TALLY_RETURN_IF_ERROR(
        engine.LoadCheckpoint(id, dir, /*load_optimizer=*/true).status());
  }
  return absl::OkStatus();
}

// One window's calls on every model: the mesh's and the single device's.
absl::Status RunCalls(Engine& engine, Engine& reference,
                      const std::vector<std::string>& ids,
                      const std::vector<std::vector<Sample>>& window) {
  for (const std::vector<Sample>& call : window) {
    for (const std::string& id : ids) {
      TALLY_RETURN_IF_ERROR(engine.ForwardBackward(id, {call}).status());
    }
    for (const char* id : {"bf16", "f32"}) {
      TALLY_RETURN_IF_ERROR(reference.ForwardBackward(id, {call}).status());
    }
  }
  return absl::OkStatus();
}

// Runs `v` on this rank: the mesh's model under each stage in `stages`,
// the single device's bf16 and float32 models, the same windows. Two
// windows are stepped, each measured after its calls and after its step
// (`slack`); with AdamW a third window's gradients are then measured from
// the float32 model's state (`shared_slack`).
absl::Status CheckVariant(Engine& engine, Engine& reference,
                          const std::vector<ZeroStage>& stages, double slack,
                          double shared_slack, const Variant& v) {
  SCOPED_TRACE(VariantName(v));
  std::vector<std::string> ids;
  for (ZeroStage stage : stages) {
    ids.push_back(absl::StrCat("stage", static_cast<int>(stage)));
    EngineTestPeer::SetZeroStage(engine, stage);
    TALLY_RETURN_IF_ERROR(
        engine.CreateModel(VariantSpec(v, ids.back(), DType::kBFloat16))
            .status());
  }
  TALLY_RETURN_IF_ERROR(
      reference.CreateModel(VariantSpec(v, "bf16", DType::kBFloat16)).status());
  TALLY_RETURN_IF_ERROR(
      reference.CreateModel(VariantSpec(v, "f32", DType::kFloat32)).status());
  std::vector<CausalLm*> models;
  for (const std::string& id : ids) {
    TALLY_ASSIGN_OR_RETURN(CausalLm * model, EngineTestPeer::Model(engine, id));
    models.push_back(model);
  }
  TALLY_ASSIGN_OR_RETURN(CausalLm * one_bf16,
                         EngineTestPeer::Model(reference, "bf16"));
  TALLY_ASSIGN_OR_RETURN(CausalLm * one_f32,
                         EngineTestPeer::Model(reference, "f32"));

  const auto windows = Windows(v.seed);
  constexpr size_t kSteppedWindows = 2;
  for (size_t w = 0; w < kSteppedWindows; ++w) {
    TALLY_RETURN_IF_ERROR(RunCalls(engine, reference, ids, windows[w]));
    TALLY_RETURN_IF_ERROR(Measure(
        models, *one_bf16, *one_f32, /*gradients=*/true, engine.world(), slack,
        absl::StrCat(VariantName(v), " gradients of window ", w)));
    OptimStepArgs step;
    step.max_grad_norm = w == 0 ? 0.0 : 1.0;
    for (const std::string& id : ids) {
      TALLY_RETURN_IF_ERROR(engine.OptimStep(id, step).status());
    }
    for (const char* id : {"bf16", "f32"}) {
      TALLY_RETURN_IF_ERROR(reference.OptimStep(id, step).status());
    }
    TALLY_RETURN_IF_ERROR(Measure(
        models, *one_bf16, *one_f32, /*gradients=*/false, engine.world(), slack,
        absl::StrCat(VariantName(v), " parameters after step ", w)));
  }
  if (v.optimizer == OptimizerKind::kAdamW) {
    std::string state_dir =
        (std::filesystem::path(::testing::TempDir()) / "mixed_precision_XXXXXX")
            .string();
    if (mkdtemp(state_dir.data()) == nullptr) {
      return absl::InternalError("mkdtemp failed for " + state_dir);
    }
    const absl::Status continued =
        ContinueFromFloat32(engine, reference, ids, state_dir);
    std::filesystem::remove_all(state_dir);
    TALLY_RETURN_IF_ERROR(continued);
    TALLY_RETURN_IF_ERROR(
        RunCalls(engine, reference, ids, windows[kSteppedWindows]));
    TALLY_RETURN_IF_ERROR(Measure(
        models, *one_bf16, *one_f32, /*gradients=*/true, engine.world(),
        shared_slack,
        absl::StrCat(VariantName(v), " gradients from the shared state")));
  }
  for (const std::string& id : ids) {
    TALLY_RETURN_IF_ERROR(engine.DeleteModel(id).status());
  }
  for (const char* id : {"bf16", "f32"}) {
    TALLY_RETURN_IF_ERROR(reference.DeleteModel(id).status());
  }
  return absl::OkStatus();
}

class MixedPrecisionContractTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(MixedPrecisionContractTest, NoFurtherFromFloat32ThanOneRank) {
  const MeshShape& shape = GetParam().shape;
  std::vector<ZeroStage> stages = {ZeroStage::kParameters};
  if (shape.dp_shard > 1) {
    stages = {ZeroStage::kParameters, ZeroStage::kGradients,
              ZeroStage::kOptimizerState};
  }
  EngineOptions options;
  options.max_batch_tokens = 48;  // several passes per call
  testing::RunGoldenOnRanks(
      shape, options, options,
      [&](Engine& engine, Engine& reference, const RankEnv&) -> absl::Status {
        for (bool lora : {false, true}) {
          for (OptimizerKind optimizer :
               {OptimizerKind::kSgd, OptimizerKind::kAdamW}) {
            for (uint64_t seed : {11, 12, 13}) {
              const bool rounded_tp =
                  GetParam().shape.tp > 1 && !HasBf16ToFloat32Matmul();
              const double slack = rounded_tp ? kTensorParallelRoundedSlack
                                   : optimizer == OptimizerKind::kAdamW
                                       ? GetParam().adamw_slack
                                       : GetParam().sgd_slack;
              const double shared_slack = rounded_tp
                                              ? kTensorParallelRoundedSlack
                                              : GetParam().shared_slack;
              TALLY_RETURN_IF_ERROR(CheckVariant(engine, reference, stages,
                                                 slack, shared_slack,
                                                 {lora, optimizer, seed}));
            }
          }
        }
        return absl::OkStatus();
      });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, MixedPrecisionContractTest,
    ::testing::Values(
        MeshCase{"dp_shard2", Shape(2, 1), kDataParallelSlack,
                 kDataParallelSlack, kDataParallelSlack},
        MeshCase{"tp2", Shape(1, 2), kTensorParallelSgdSlack,
                 kTensorParallelAdamWSlack, kTensorParallelSharedStateSlack},
        MeshCase{"dp_shard2_tp2", Shape(2, 2), kTensorParallelSgdSlack,
                 kTensorParallelAdamWSlack, kTensorParallelSharedStateSlack}),
    MeshName);

}  // namespace
}  // namespace tally
