// Golden tests of LoRA adapters (runtime/model/lora.h): an adapter over a
// frozen base trained on a mesh equals the same adapter trained on a single
// device. Real rank processes on loopback each run a multi-rank engine and, in
// the same process, a single-rank reference on the same samples (as
// multirank_golden_test.cc): per-call losses, the adapters' gradients, the
// norm, the clip coefficient and every adapter parameter after two windows,
// in fp64 at 1e-10 relative, while the base stays bitwise what it was. The
// meshes split the factors every way the layout has: dp_shard x tp (A whole
// over tp and B by output rows for column-parallel projections, A by input
// columns and B whole for row-parallel ones, both dim-0 sharded over
// dp_shard) and pp x tp (each stage its layers' adapters, the unembedding's
// on the last). A single-rank test checks that the reported norm counts the
// adapters' gradients only.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/config/lora_config.h"
#include "runtime/engine/engine.h"
#include "runtime/model/lora.h"
#include "runtime/parallel/distributed.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/golden.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::MakeSamples;
using testing::RelativeDiff;

constexpr double kTol = 1e-10;  // testing::GoldenTolerance(kFloat64)

struct MeshCase {
  const char* name;
  MeshShape shape;
};

MeshShape Shape(int pp, int dp_shard, int tp) {
  MeshShape shape;
  shape.pp = pp;
  shape.dp_shard = dp_shard;
  shape.tp = tp;
  return shape;
}

std::string MeshName(const ::testing::TestParamInfo<MeshCase>& info) {
  return info.param.name;
}

// TinyConfig (hidden 32, 4 heads of 8, 2 kv heads, intermediate 40, vocab
// 48: tp 2 divides every split size) with the adapter, fp64, AdamW with
// weight decay 0.1 (which would move a base that stepped).
ModelSpec LoraSpec(const std::string& id, bool tied) {
  ModelSpec spec =
      testing::TinySpec(id, DType::kFloat64, OptimizerKind::kAdamW);
  spec.config = testing::TinyConfig(tied);
  spec.lora = testing::TestLora();
  return spec;
}

bool IsLoraA(const std::string& name) {
  return absl::EndsWith(name, ".lora_A.weight");
}
bool IsLoraB(const std::string& name) {
  return absl::EndsWith(name, ".lora_B.weight");
}

// FNV-1a: a seed per parameter name, the same in every process.
uint64_t NameSeed(const std::string& name) {
  uint64_t h = 14695981039346656037ull;
  for (const char c : name) {
    h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  }
  return h;
}

// B starts at zero, which leaves A without gradient: writes into every
// lora_B factor this rank holds its shard of one full normal(0, 0.05)
// tensor drawn from the factor's name, the same on every rank and engine.
// Returns how many it wrote.
int SetLoraB(CausalLm& model) {
  torch::NoGradGuard no_grad;
  int written = 0;
  for (Parameter& p : model.parameters()) {
    if (!IsLoraB(p.name)) continue;
    at::Generator generator =
        at::make_generator<at::CPUGeneratorImpl>(NameSeed(p.name));
    torch::Tensor full = torch::empty(p.full_shape, torch::kFloat64)
                             .normal_(0.0, 0.05, generator);
    p.tensor.copy_(model.LocalShard(p, full));
    ++written;
  }
  return written;
}

// Two windows of two calls each, few tokens. The first call holds one valid
// token (one data rank of dp_shard 2 gets nothing); the others mix long,
// short and fully ignored samples.
std::vector<std::vector<std::vector<Sample>>> Windows() {
  const int64_t vocab = testing::TinyConfig().vocab_size;
  return {{MakeSamples(vocab, {1}, 31), MakeSamples(vocab, {12, 3, 0, 7}, 32)},
          {MakeSamples(vocab, {9, 2, 5}, 33), MakeSamples(vocab, {4, 11}, 34)}};
}

// Window 0 does not clip; window 1 clips hard.
OptimStepArgs WindowStep(int window) {
  OptimStepArgs args;
  args.max_grad_norm = window == 0 ? 0.0 : 1e-3;
  return args;
}

// Micro-batches of at most 16 tokens: several per call.
EngineOptions Options() {
  EngineOptions options;
  options.max_batch_tokens = 16;
  return options;
}

// One adapter trained for Windows() on this rank's `engine` and on the
// single-device `reference`; every rank checks its shards.
absl::Status CheckAdapter(Engine& engine, Engine& reference,
                          const std::string& id, bool tied,
                          LossReduction reduction) {
  SCOPED_TRACE(
      absl::StrCat(id, tied ? " tied " : " untied ", ReductionName(reduction)));
  const ModelSpec spec = LoraSpec(id, tied);
  TALLY_RETURN_IF_ERROR(reference.CreateModel(spec).status());
  TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
  CausalLm& model = *EngineTestPeer::Model(engine, id).value();
  CausalLm& ref_model = *EngineTestPeer::Model(reference, id).value();
  EXPECT_TRUE(model.lora().enabled());
  EXPECT_NE(model.base(), nullptr);

  // Only the factors train. The adapter's A draw and the base do not depend
  // on the mesh: this rank's shards are the reference's, bitwise.
  int factors = 0;
  for (const Parameter& p : model.parameters()) {
    EXPECT_EQ(p.trainable, IsLoraParameter(p.name)) << p.name;
    factors += IsLoraParameter(p.name) ? 1 : 0;
    const Parameter* want = ref_model.Find(p.name);
    if (want == nullptr) {
      ADD_FAILURE() << p.name << " missing from the reference";
      continue;
    }
    EXPECT_TRUE(torch::equal(p.tensor, model.LocalShard(p, want->tensor)))
        << p.name;
  }
  // Per held layer 7 projections x 2 factors, the unembedding's 2 on the
  // last stage.
  const int64_t layers =
      model.config().num_hidden_layers / model.sharding().pp_stages;
  EXPECT_EQ(factors, 14 * layers + (model.last_stage() ? 2 : 0));
  EXPECT_EQ(SetLoraB(model), factors / 2);
  EXPECT_EQ(SetLoraB(ref_model), 7 * ref_model.config().num_hidden_layers + 1);
  const std::vector<torch::Tensor> initial = testing::ParameterValues(model);

  const auto windows = Windows();
  for (size_t w = 0; w < windows.size(); ++w) {
    SCOPED_TRACE(absl::StrCat("window ", w));
    for (size_t c = 0; c < windows[w].size(); ++c) {
      SCOPED_TRACE(absl::StrCat("call ", c));
      const std::vector<Sample>& call = windows[w][c];
      ForwardBackwardArgs args{call, reduction};
      TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult got,
                             engine.ForwardBackward(id, args));
      TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult want,
                             reference.ForwardBackward(id, args));
      testing::ExpectSameCall(got, want, kTol);
    }
    // This rank's gradient shards are the single device's; the base has
    // none, here or in the reference. Every factor takes a gradient: A's is
    // nonzero because B is.
    testing::ExpectGradientShards(model, ref_model, kTol);
    for (const Parameter& p : ref_model.parameters()) {
      if (p.trainable && p.tensor.grad().defined()) {
        EXPECT_GT(p.tensor.grad().abs().max().item<double>(), 0) << p.name;
      }
    }

    const OptimStepArgs step = WindowStep(static_cast<int>(w));
    TALLY_ASSIGN_OR_RETURN(OptimStepResult got, engine.OptimStep(id, step));
    TALLY_ASSIGN_OR_RETURN(OptimStepResult want, reference.OptimStep(id, step));
    testing::ExpectSameStep(got, want, step, kTol);
  }

  // Every adapter parameter, as this rank's shard and gathered whole, is the
  // single device's; A moved; the base is bitwise what it was.
  const std::vector<Parameter>& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = params[i];
    const Parameter& ref = *ref_model.Find(p.name);
    if (!p.trainable) {
      EXPECT_TRUE(torch::equal(p.tensor, initial[i])) << p.name;
      EXPECT_TRUE(torch::equal(p.tensor, model.LocalShard(p, ref.tensor)))
          << p.name;
      continue;
    }
    EXPECT_LT(RelativeDiff(p.tensor, model.LocalShard(p, ref.tensor)), kTol)
        << p.name;
    TALLY_ASSIGN_OR_RETURN(torch::Tensor full, model.GatherFull(p, p.tensor));
    EXPECT_EQ(full.sizes(), ref.tensor.sizes()) << p.name;
    if (full.sizes() == ref.tensor.sizes()) {
      EXPECT_LT(RelativeDiff(full, ref.tensor), kTol) << p.name;
    }
    if (IsLoraA(p.name)) {
      EXPECT_FALSE(torch::equal(p.tensor, initial[i]))
          << p.name << " did not move";
    }
    // A factor whole over tp (A of a column-parallel projection, B of a
    // row-parallel one) took the gradient summed over tp: its copies are
    // bitwise identical.
    Communicator& tp = *engine.groups().tp;
    if (tp.size() > 1 && !p.placements.at(MeshDim::kTp).is_shard()) {
      const torch::Tensor own = p.tensor.detach().flatten();
      TALLY_ASSIGN_OR_RETURN(torch::Tensor copies, tp.AllGather(own));
      for (const torch::Tensor& copy : copies.chunk(tp.size())) {
        EXPECT_TRUE(torch::equal(copy, own)) << p.name << " differs over tp";
      }
    }
  }
  return absl::OkStatus();
}

class LoraGoldenTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(LoraGoldenTest, EqualsTheSingleDeviceRun) {
  testing::RunGoldenOnRanks(
      GetParam().shape, Options(), Options(),
      [&](Engine& engine, Engine& reference, const RankEnv&) -> absl::Status {
        // Tied (the unembedding's adapter on the vocab-parallel embedding)
        // and untied, each under TOKEN_MEAN and SUM; the two adapters of a
        // config share one base.
        for (const bool tied : {false, true}) {
          for (const LossReduction reduction :
               {LossReduction::kTokenMean, LossReduction::kSum}) {
            TALLY_RETURN_IF_ERROR(
                CheckAdapter(engine, reference,
                             absl::StrCat(tied ? "tied_" : "untied_",
                                          ReductionName(reduction)),
                             tied, reduction));
          }
        }
        return absl::OkStatus();
      });
}

INSTANTIATE_TEST_SUITE_P(LoraMeshes, LoraGoldenTest,
                         ::testing::Values(MeshCase{"dp_shard2_tp2",
                                                    Shape(1, 2, 2)},
                                           MeshCase{"pp2_tp2", Shape(2, 1, 2)}),
                         MeshName);

// An adapter of the head only on pp 2: the first stage has nothing to train
// (its output carries no gradient) and still takes part in the schedule; the
// run equals the single device's.
TEST(LoraPipelineTest, HeadOnlyAdapterTrainsOnTwoStages) {
  testing::RunGoldenOnRanks(
      Shape(2, 1, 1), Options(), Options(),
      [&](Engine& engine, Engine& reference, const RankEnv&) -> absl::Status {
        ModelSpec spec = LoraSpec("head", /*tied=*/false);
        spec.lora.train_attn = spec.lora.train_mlp = false;
        TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
        TALLY_RETURN_IF_ERROR(reference.CreateModel(spec).status());
        CausalLm& model = *EngineTestPeer::Model(engine, "head").value();
        CausalLm& ref_model = *EngineTestPeer::Model(reference, "head").value();
        SetLoraB(model);
        SetLoraB(ref_model);
        for (const auto& window : Windows()) {
          for (const std::vector<Sample>& call : window) {
            ForwardBackwardArgs args{call};
            TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult got,
                                   engine.ForwardBackward("head", args));
            TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult want,
                                   reference.ForwardBackward("head", args));
            EXPECT_LT(RelativeDiff(got.loss_sum, want.loss_sum), kTol);
          }
          TALLY_ASSIGN_OR_RETURN(OptimStepResult got,
                                 engine.OptimStep("head", {}));
          TALLY_ASSIGN_OR_RETURN(OptimStepResult want,
                                 reference.OptimStep("head", {}));
          EXPECT_GT(want.grad_norm, 0);
          EXPECT_LT(RelativeDiff(got.grad_norm, want.grad_norm), kTol);
        }
        for (const Parameter& p : model.parameters()) {
          EXPECT_EQ(p.trainable, model.last_stage() && IsLoraParameter(p.name))
              << p.name;
          if (p.trainable) {
            EXPECT_LT(RelativeDiff(p.tensor, ref_model.Find(p.name)->tensor),
                      kTol)
                << p.name;
          }
        }
        return absl::OkStatus();
      });
}

// The reported norm is that of the adapters' normalized gradients alone:
// the base takes no gradient, no slot in the norm and no step (AdamW's
// weight decay would move it), under both reductions.
TEST(LoraNormTest, CountsOnlyTheAdapterParameters) {
  std::unique_ptr<Engine> engine = Engine::CreateSingleRank({}).value();
  for (LossReduction reduction :
       {LossReduction::kTokenMean, LossReduction::kSum}) {
    SCOPED_TRACE(ReductionName(reduction));
    const std::string id = absl::StrCat("norm_", ReductionName(reduction));
    const ModelSpec spec = LoraSpec(id, /*tied=*/false);
    absl::StatusOr<ModelSummary> summary = engine->CreateModel(spec);
    ASSERT_TRUE(summary.ok()) << summary.status();
    CausalLm& model = *EngineTestPeer::Model(*engine, id).value();
    ASSERT_NE(model.base(), nullptr);
    ASSERT_GT(SetLoraB(model), 0);

    // The summary's trainable count is the adapter's.
    uint64_t trainable = 0;
    std::vector<torch::Tensor> base_before;
    for (const Parameter& p : model.parameters()) {
      if (p.trainable) {
        EXPECT_TRUE(IsLoraParameter(p.name)) << p.name;
        trainable += static_cast<uint64_t>(p.tensor.numel());
      } else {
        EXPECT_FALSE(p.tensor.requires_grad()) << p.name;
        base_before.push_back(p.tensor.detach().clone());
        // The shared base's own tensor, not a copy.
        const Parameter* shared = model.base()->Find(p.name);
        ASSERT_NE(shared, nullptr) << p.name;
        EXPECT_EQ(p.tensor.data_ptr(), shared->tensor.data_ptr()) << p.name;
      }
    }
    EXPECT_EQ(trainable, static_cast<uint64_t>(
                             LoraParameterCount(spec.config, model.lora())));
    EXPECT_EQ(summary->trainable_parameters, trainable);
    ASSERT_LT(base_before.size(), model.parameters().size());
    ASSERT_FALSE(base_before.empty());

    int64_t valid = 0;
    const auto windows = Windows();
    for (const std::vector<Sample>& call : windows[0]) {
      absl::StatusOr<ForwardBackwardResult> r =
          engine->ForwardBackward(id, {call, reduction});
      ASSERT_TRUE(r.ok()) << r.status();
      valid += r->valid_tokens;
    }
    const double normalizer = reduction == LossReduction::kTokenMean
                                  ? static_cast<double>(valid)
                                  : 1.0;
    // sqrt(sum g^2) of the normalized gradients of the trainable parameters;
    // the frozen ones have none.
    double squares = 0;
    for (const Parameter& p : model.parameters()) {
      const torch::Tensor& grad = p.tensor.grad();
      if (!p.trainable) {
        EXPECT_FALSE(grad.defined()) << p.name;
        continue;
      }
      ASSERT_TRUE(grad.defined()) << p.name;
      squares += (grad / normalizer).pow(2).sum().item<double>();
    }
    const double expected = std::sqrt(squares);
    ASSERT_GT(expected, 0);

    OptimStepArgs args;
    args.max_grad_norm = 0;  // report the norm, never clip
    absl::StatusOr<OptimStepResult> step = engine->OptimStep(id, args);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_FALSE(step->skipped) << step->skip_reason;
    EXPECT_EQ(step->normalizer, normalizer);
    EXPECT_LT(RelativeDiff(step->grad_norm, expected), 1e-12)
        << step->grad_norm << " vs " << expected;
    EXPECT_LT(RelativeDiff(step->metrics["grad_norm_dense"], expected), 1e-12);

    size_t k = 0;
    for (const Parameter& p : model.parameters()) {
      if (p.trainable) continue;
      EXPECT_TRUE(torch::equal(p.tensor, base_before[k++]))
          << p.name << " changed";
    }
  }
}

}  // namespace
}  // namespace tally
