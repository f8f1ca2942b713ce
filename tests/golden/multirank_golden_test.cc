// Golden tests of the multi-rank runtime: real rank processes on loopback,
// each running a multi-rank engine, and in the same process a single-rank
// engine on the same samples. Every rank checks its own shards against the
// matching shards of the single-device run: losses, gradients (EAGER),
// norm, clip coefficient and updated parameters. The ep meshes run a 4-expert
// Mixtral-style model. Every MultiRankGoldenTest mesh runs all three
// reductions, both norms and tied and untied embeddings, two of them also a
// 4-layer, hidden-128 model over three steps of changing hyperparameters,
// all in one launch of rank processes per mesh.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/config/loss_spec.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/grad_norm.h"
#include "runtime/parallel/parallel_ops.h"
#include "runtime/train/accumulation.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/golden.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::FamilyConfig;
using testing::MakeSamples;
using testing::MoeConfig;
using testing::RelativeDiff;
using testing::TinySpec;

struct MeshCase {
  const char* name;
  MeshShape shape;
  bool moe = false;
  // MultiRankGoldenTest also runs the LargeConfig golden (kScheduleSteps
  // steps) here: kept to few meshes for CI time.
  bool large_model = false;
  // The model family (FamilyConfig); nullptr: llama (or mixtral with moe).
  const char* family = nullptr;
  // What dp_shard shards (EngineOptions::zero_stage).
  ZeroStage zero_stage = ZeroStage::kParameters;
};

using testing::Shape;

MeshShape PipelineShape(int pp, int dp_shard = 1, int tp = 1, int cp = 1,
                        int ep = 1) {
  return Shape(1, dp_shard, tp, cp, ep, pp);
}

// TinyConfig widened to hidden 128: 8 heads of 16 (4 kv heads) and
// intermediate 256, so tp 2 and 4 divide every split size; same vocabulary,
// so Calls() apply.
LlamaConfig LargeConfig(bool tied, int64_t layers) {
  LlamaConfig config = testing::TinyConfig(tied, layers);
  config.hidden_size = 128;
  config.intermediate_size = 256;
  config.num_attention_heads = 8;
  config.num_key_value_heads = 4;
  return config;
}

ModelSpec Spec(const std::string& id, DType dtype, OptimizerKind optimizer,
               bool moe, bool tied = false, int64_t layers = 2,
               bool large = false, const char* family = nullptr) {
  ModelSpec spec = TinySpec(id, dtype, optimizer);
  spec.config =
      large ? LargeConfig(tied, layers) : testing::TinyConfig(tied, layers);
  if (moe) spec.config = MoeConfig(spec.config);
  spec.config = FamilyConfig(spec.config, family);
  return spec;
}

// The group over which the engine sums p's partial gradients.
Communicator* ReplicaGroup(const Engine& engine, const Parameter& p) {
  return p.is_expert ? engine.groups().expert_replicas
                     : engine.groups().replicas;
}

struct Variant {
  DType dtype;
  OptimizerKind optimizer;
  GradSync sync;
  LossReduction reduction;
  NormType norm = NormType::kL2;
  bool tied = false;
  int64_t layers = 2;  // 4 for pp = 4
  bool large = false;  // LargeConfig instead of TinyConfig
  // Optimizer steps, each after the three Calls(), with StepArgs(step).
  int steps = 1;
  const char* family = nullptr;  // see MeshCase::family
  // The mesh's model recomputes its layers in backward (the single-device
  // reference keeps its activations).
  bool activation_checkpointing = false;
  // The calls carry the RL losses' inputs and signed weights, and each
  // names its own loss (PolicyLossOfCall).
  bool policy_losses = false;
};

// The steps of the large golden: hyperparameters change at every step.
constexpr int kScheduleSteps = 3;

std::string VariantName(const Variant& v) {
  return absl::StrCat(
      DTypeName(v.dtype), "/", OptimizerName(v.optimizer), "/",
      v.sync == GradSync::kEager ? "eager" : "deferred", "/",
      ReductionName(v.reduction), "/", v.norm == NormType::kInf ? "inf" : "l2",
      v.tied ? "/tied" : "", v.large ? "/hidden128" : "",
      v.layers != 2 ? absl::StrCat("/", v.layers, "_layers") : "",
      v.steps != 1 ? absl::StrCat("/", v.steps, "_steps") : "",
      v.family != nullptr ? absl::StrCat("/", v.family) : "",
      v.activation_checkpointing ? "/recompute" : "",
      v.policy_losses ? "/policy_losses" : "");
}

// The arguments of step `step`. Step 0, the only one of most variants, clips
// hard (max_grad_norm far below the norm) under the model defaults; steps 1
// and 2 change the learning rate, weight decay, AdamW's betas and
// max_grad_norm: no clipping (0), then clipping at another bound.
OptimStepArgs StepArgs(const Variant& v, int step) {
  OptimStepArgs args;
  args.norm_type = v.norm;
  const int k = step % 3;
  args.max_grad_norm = std::array<double, 3>{0.05, 0, 0.02}[k];
  if (k == 0) return args;
  args.adam.learning_rate = k == 1 ? 3e-3 : 2e-2;
  args.adam.weight_decay = k == 1 ? 0.0 : 0.3;
  if (v.optimizer == OptimizerKind::kAdamW) {
    args.adam.beta1 = k == 1 ? 0.8 : 0.5;
    args.adam.beta2 = k == 1 ? 0.95 : 0.99;
  }
  return args;
}

// Micro-batches of at most 96 tokens (several per call), at `zero_stage`.
EngineOptions GoldenOptions(ZeroStage zero_stage) {
  EngineOptions options;
  options.max_batch_tokens = 96;
  options.zero_stage = zero_stage;
  return options;
}

// This rank's engine on `shape` and a single-device reference, both with
// GoldenOptions.
struct GoldenEngines {
  std::unique_ptr<Engine> mesh;
  std::unique_ptr<Engine> reference;
};

absl::StatusOr<GoldenEngines> CreateGoldenEngines(
    const MeshShape& shape, const RankEnv& env,
    ZeroStage zero_stage = ZeroStage::kParameters) {
  const EngineOptions options = GoldenOptions(zero_stage);
  GoldenEngines engines;
  TALLY_ASSIGN_OR_RETURN(engines.mesh,
                         testing::CreateRankEngine(shape, env, options));
  TALLY_ASSIGN_OR_RETURN(engines.reference, Engine::CreateSingleRank(options));
  return engines;
}

// Runs `body` on every rank of `mesh` with that rank's engine (at the mesh's
// ZeRO stage) and its single-device reference.
void RunGolden(const MeshCase& mesh, const testing::GoldenBody& body) {
  const EngineOptions options = GoldenOptions(mesh.zero_stage);
  testing::RunGoldenOnRanks(mesh.shape, options, options, body);
}

// Three calls of very uneven size: the first holds one valid token (so
// every data rank but one has nothing), the others mix long, short and
// fully ignored samples. For context parallelism the second also holds
// samples of 1 and 3 tokens (empty chunks) and a 16-token sample whose
// valid targets split unevenly over the cp shards: 3 and 2 at cp = 2;
// 2, 1, none and 2 at cp = 4.
std::vector<std::vector<Sample>> Calls() {
  const int64_t vocab = testing::TinyConfig().vocab_size;
  std::vector<Sample> mixed = MakeSamples(vocab, {50, 3, 0, 7}, 22);
  mixed.push_back(testing::MakeSampleValidAt(vocab, 16, {0, 1, 2, 6, 7}, 24));
  mixed.push_back(testing::MakeSample(vocab, 1, 1, 25));
  mixed.push_back(testing::MakeSample(vocab, 3, 2, 26));
  return {MakeSamples(vocab, {1}, 21), mixed,
          MakeSamples(vocab, {120, 2, 9, 30, 1}, 23)};
}

// The loss of call `call` of step `step` of a policy_losses variant: each
// window mixes three losses, and two steps name all five, with settings
// away from the defaults.
LossSpec PolicyLossOfCall(int step, int call) {
  const std::vector<std::string> names = LossNames();
  LossSpec spec = ParseLossSpec(names[(3 * step + call) % names.size()], {})
                      .value_or(LossSpec());
  if (spec.name == "ppo" || spec.name == "cispo") {
    spec.settings = {{"clip_low_threshold", 0.9},
                     {"clip_high_threshold", 1.15}};
  }
  if (spec.name == "dro") spec.settings = {{"beta", 0.3}};
  return spec;
}

// The calls of `v`'s windows (Calls(), with the RL inputs for
// policy_losses).
std::vector<std::vector<Sample>> VariantCalls(const Variant& v) {
  std::vector<std::vector<Sample>> calls = Calls();
  if (!v.policy_losses) return calls;
  const double uniform_logprob = -std::log(testing::TinyConfig().vocab_size);
  for (size_t c = 0; c < calls.size(); ++c) {
    testing::AddPolicyInputs(calls[c], uniform_logprob, 40 + c);
  }
  return calls;
}

// The per-token losses and policy statistics of a call's sample.
void ExpectSameLossReport(const SampleResult& got, const SampleResult& want,
                          double tol) {
  ASSERT_EQ(got.token_losses.size(), want.token_losses.size());
  for (size_t t = 0; t < got.token_losses.size(); ++t) {
    EXPECT_NEAR(got.token_losses[t], want.token_losses[t], tol * 10) << t;
  }
  ASSERT_EQ(got.policy.has_value(), want.policy.has_value());
  if (!got.policy) return;
  EXPECT_EQ(got.policy->tokens, want.policy->tokens);
  EXPECT_EQ(got.policy->clipped_fraction, want.policy->clipped_fraction);
  EXPECT_LT(RelativeDiff(got.policy->ratio_max, want.policy->ratio_max), tol);
  EXPECT_LT(RelativeDiff(got.policy->kl_k3, want.policy->kl_k3), tol + 1e-300);
}

// This rank's shard of p's gradient as the engine holds it before OptimStep:
// its .grad, plus under ZeRO-1 the dp_shard sum of the ranks' whole
// gradients not yet reduced into it (all of the window's with DEFERRED,
// none with EAGER), sliced here.
absl::StatusOr<torch::Tensor> UnsummedGradientShard(Engine& engine,
                                                    const Parameter& p) {
  torch::Tensor shard = p.tensor.grad().defined() ? p.tensor.grad().clone()
                                                  : torch::zeros_like(p.tensor);
  if (p.gathered == nullptr || !p.gathered->whole_gradient) return shard;
  Communicator& dp_shard = *engine.groups().dp_shard;
  torch::Tensor whole = p.gathered->grad.clone();
  TALLY_RETURN_IF_ERROR(dp_shard.AllReduce(whole, ReduceOp::kSum));
  return shard + ShardDim0(whole, dp_shard.rank(), dp_shard.size());
}

// Checks one variant on this rank, step by step; gtest failures are
// reported by the rank.
absl::Status CheckVariant(Engine& engine, Engine& reference, const Variant& v,
                          const std::string& id, bool moe) {
  SCOPED_TRACE(VariantName(v));
  // RelativeDiff bounds: testing::GoldenTolerance (logprobs: 10x, absolute),
  // and for parameters after an fp32 AdamW step kFp32AdamParamTolerance.
  const double tol = testing::GoldenTolerance(v.dtype);
  ModelSpec spec =
      Spec(id, v.dtype, v.optimizer, moe, v.tied, v.layers, v.large, v.family);
  spec.grad_sync = v.sync;
  const bool fp32_adamw =
      v.dtype == DType::kFloat32 && v.optimizer == OptimizerKind::kAdamW;
  const double param_tol = fp32_adamw ? testing::kFp32AdamParamTolerance : tol;
  TALLY_RETURN_IF_ERROR(reference.CreateModel(spec).status());
  spec.activation_checkpointing = v.activation_checkpointing;
  TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
  CausalLm& model = *EngineTestPeer::Model(engine, id).value();
  CausalLm& ref_model = *EngineTestPeer::Model(reference, id).value();
  Parameter* tied = model.SplitTiedEmbedding();
  const int tied_peer =
      model.first_stage() ? engine.groups().pp->size() - 1 : 0;

  const std::vector<std::vector<Sample>> calls = VariantCalls(v);
  for (int step = 0; step < v.steps; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    for (size_t c = 0; c < calls.size(); ++c) {
      const std::vector<Sample>& call = calls[c];
      ForwardBackwardArgs args{call, v.reduction};
      args.return_logprobs = true;
      if (v.policy_losses) args.loss = PolicyLossOfCall(step, c);
      SCOPED_TRACE(args.loss.name);
      TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult got,
                             engine.ForwardBackward(id, args));
      TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult want,
                             reference.ForwardBackward(id, args));
      EXPECT_LT(RelativeDiff(got.loss_sum, want.loss_sum), tol);
      EXPECT_EQ(got.valid_tokens, want.valid_tokens);
      EXPECT_EQ(got.num_samples, want.num_samples);
      EXPECT_EQ(got.window.tokens, want.window.tokens);
      EXPECT_EQ(got.window.samples, want.window.samples);
      // Expert load counts real tokens only, summed over the data ranks.
      for (const auto& [key, value] : want.metrics) {
        if (absl::StartsWith(key, "expert_")) {
          EXPECT_EQ(got.metrics[key], value) << key;
        }
      }
      EXPECT_EQ(got.metrics.count("expert_load_min_fraction"), moe ? 1u : 0u);
      if (moe && call.size() == 1) {
        EXPECT_EQ(got.metrics["expert_load_min_fraction"], 0.0);
      }
      for (size_t i = 0; i < call.size(); ++i) {
        EXPECT_LT(
            RelativeDiff(got.samples[i].loss_sum, want.samples[i].loss_sum),
            tol + 1e-300);
        EXPECT_EQ(got.samples[i].logprobs.size(),
                  want.samples[i].logprobs.size());
        const size_t n = std::min(got.samples[i].logprobs.size(),
                                  want.samples[i].logprobs.size());
        for (size_t t = 0; t < n; ++t) {
          EXPECT_NEAR(got.samples[i].logprobs[t], want.samples[i].logprobs[t],
                      tol * 10);
        }
        ExpectSameLossReport(got.samples[i], want.samples[i], tol);
      }
      EXPECT_EQ(got.policy.has_value(), v.policy_losses);
    }
    // EAGER: summed over the replicas (dp_replicate x cp; experts: the
    // expert-data-parallel ranks) after every call, so this rank's gradient
    // shard is the single-device gradient's shard. DEFERRED: the replicas'
    // local gradients sum to it (OptimStep does that sum), and under ZeRO-1
    // the dp_shard ranks' whole gradients do. Under pp the two copies of a
    // tied embedding likewise sum to it.
    for (Parameter& p : model.parameters()) {
      TALLY_ASSIGN_OR_RETURN(torch::Tensor got,
                             UnsummedGradientShard(engine, p));
      Communicator* replicas = ReplicaGroup(engine, p);
      if (v.sync == GradSync::kDeferred && replicas->size() > 1) {
        TALLY_RETURN_IF_ERROR(replicas->AllReduce(got, ReduceOp::kSum));
      }
      if (v.sync == GradSync::kDeferred && &p == tied) {
        torch::Tensor other = torch::empty_like(got);
        TALLY_RETURN_IF_ERROR(
            engine.groups().pp->SendRecv(got, tied_peer, other, tied_peer));
        got += other;
      }
      torch::Tensor want =
          model.LocalShard(p, ref_model.Find(p.name)->tensor.grad());
      EXPECT_LT(RelativeDiff(got, want), tol) << p.name;
    }

    const OptimStepArgs args = StepArgs(v, step);
    TALLY_ASSIGN_OR_RETURN(OptimStepResult got, engine.OptimStep(id, args));
    TALLY_ASSIGN_OR_RETURN(OptimStepResult want, reference.OptimStep(id, args));
    EXPECT_FALSE(want.skipped) << want.skip_reason;
    EXPECT_FALSE(got.skipped) << got.skip_reason;
    EXPECT_EQ(got.step, step + 1);
    EXPECT_EQ(want.step, step + 1);
    EXPECT_EQ(got.learning_rate, want.learning_rate);
    EXPECT_LT(RelativeDiff(got.grad_norm, want.grad_norm), tol);
    EXPECT_LT(RelativeDiff(got.clip_coef, want.clip_coef), tol);
    if (*args.max_grad_norm > 0) {
      EXPECT_LT(got.clip_coef, 0.5);
    } else {
      EXPECT_EQ(got.clip_coef, 1.0);
    }
    for (const char* slot : {"grad_norm_dense", "grad_norm_expert"}) {
      EXPECT_LT(RelativeDiff(got.metrics[slot], want.metrics[slot]), tol)
          << slot;
    }
    EXPECT_EQ(got.metrics["grad_norm_expert"] > 0, moe);
    EXPECT_EQ(got.normalizer, want.normalizer);

    // The norm is the same bits on every rank.
    torch::Tensor norm = torch::tensor({got.grad_norm}, torch::kFloat64);
    TALLY_ASSIGN_OR_RETURN(torch::Tensor norms, engine.world().AllGather(norm));
    for (int r = 0; r < norms.size(0); ++r) {
      EXPECT_EQ(norms[r].item<double>(), got.grad_norm) << "rank " << r;
    }

    if (tied != nullptr) {
      torch::Tensor own = tied->tensor.detach().contiguous();
      torch::Tensor other = torch::empty_like(own);
      TALLY_RETURN_IF_ERROR(
          engine.groups().pp->SendRecv(own, tied_peer, other, tied_peer));
      EXPECT_TRUE(torch::equal(own, other)) << "tied embedding copies differ";
    }

    for (const Parameter& p : model.parameters()) {
      torch::Tensor want = model.LocalShard(p, ref_model.Find(p.name)->tensor);
      EXPECT_LT(RelativeDiff(p.tensor, want), param_tol) << p.name;
      // Replicas are bitwise identical: across dp_replicate and cp for
      // everything (experts: across the expert-data-parallel ranks), across
      // tp for what tp replicates.
      std::vector<Communicator*> replica_groups = {ReplicaGroup(engine, p)};
      if (!p.placements.at(MeshDim::kTp).is_shard()) {
        replica_groups.push_back(engine.groups().tp);
      }
      for (Communicator* group : replica_groups) {
        if (group->size() == 1) continue;
        TALLY_ASSIGN_OR_RETURN(torch::Tensor copies,
                               group->AllGather(p.tensor.detach().flatten()));
        for (const torch::Tensor& copy : copies.chunk(group->size())) {
          EXPECT_TRUE(torch::equal(copy, p.tensor.detach().flatten()))
              << p.name;
        }
      }
    }
  }
  return absl::OkStatus();
}

// A checkpoint saved on the mesh is one consolidated HF directory: the
// single-rank engine loads it bitwise, and both then take the same next step
// (optimizer state included); a single-rank checkpoint loads on the mesh.
absl::Status CheckCheckpointsAcrossMeshes(Engine& engine, Engine& reference,
                                          const std::string& id,
                                          const RankEnv& env) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "tally_golden_",
                                       env.master_port, "_", id);
  // Rank 0 writes; SaveCheckpoint returns on every rank once it has.
  TALLY_RETURN_IF_ERROR(engine.SaveCheckpoint(id, dir).status());
  TALLY_RETURN_IF_ERROR(reference.LoadCheckpoint(id, dir, true).status());
  CausalLm& model = *EngineTestPeer::Model(engine, id).value();
  CausalLm& ref_model = *EngineTestPeer::Model(reference, id).value();
  for (const Parameter& p : model.parameters()) {
    EXPECT_TRUE(torch::equal(
        p.tensor, model.LocalShard(p, ref_model.Find(p.name)->tensor)))
        << p.name;
  }
  const std::string single_dir = absl::StrCat(dir, "_single_rank", env.rank);
  TALLY_RETURN_IF_ERROR(reference.SaveCheckpoint(id, single_dir).status());

  // A checkpoint that one rank cannot read: every rank refuses, none loads.
  const std::vector<torch::Tensor> before = testing::ParameterValues(model);
  TALLY_RETURN_IF_ERROR(engine.ForwardBackward(id, {Calls()[1]}).status());
  const std::string unreadable_on_last_rank =
      env.rank == env.world_size - 1 ? dir + "_missing" : dir;
  EXPECT_FALSE(engine.LoadCheckpoint(id, unreadable_on_last_rank, true).ok());
  EXPECT_EQ(engine.GetModel(id)->window.calls, 1);  // kept everywhere
  const std::vector<torch::Tensor> after = testing::ParameterValues(model);
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i], after[i])) << i;
  }
  TALLY_RETURN_IF_ERROR(engine.AbortAccumulation(id).status());
  TALLY_RETURN_IF_ERROR(engine.LoadCheckpoint(id, single_dir, true).status());
  for (const std::vector<Sample>& call : Calls()) {
    TALLY_RETURN_IF_ERROR(engine.ForwardBackward(id, {call}).status());
    TALLY_RETURN_IF_ERROR(reference.ForwardBackward(id, {call}).status());
  }
  TALLY_ASSIGN_OR_RETURN(OptimStepResult got, engine.OptimStep(id, {}));
  TALLY_ASSIGN_OR_RETURN(OptimStepResult want, reference.OptimStep(id, {}));
  EXPECT_EQ(got.step, want.step);
  EXPECT_LT(RelativeDiff(got.grad_norm, want.grad_norm), 1e-10);
  for (const Parameter& p : model.parameters()) {
    EXPECT_LT(RelativeDiff(p.tensor,
                           model.LocalShard(p, ref_model.Find(p.name)->tensor)),
              1e-10)
        << p.name;
  }
  return absl::OkStatus();
}

class MultiRankGoldenTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(MultiRankGoldenTest, EqualsTheSingleDeviceRun) {
  const MeshShape shape = GetParam().shape;
  const bool moe = GetParam().moe;
  testing::RunOnRanks(
      shape.world_size(), [&](const RankEnv& env) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(GoldenEngines engines,
                               CreateGoldenEngines(shape, env));
        std::unique_ptr<Engine>& engine = engines.mesh;
        std::unique_ptr<Engine>& reference = engines.reference;
        const DType f64 = DType::kFloat64;
        const OptimizerKind adam = OptimizerKind::kAdamW;
        std::vector<Variant> variants;
        for (GradSync sync : {GradSync::kEager, GradSync::kDeferred}) {
          for (LossReduction reduction :
               {LossReduction::kTokenMean, LossReduction::kSampleMean}) {
            variants.push_back({f64, adam, sync, reduction});
          }
        }
        // SUM and INF under both syncs; a tied embedding (without pp one
        // vocab-parallel weight, the embedding's and lm_head's gradients
        // summing in it).
        variants.push_back({f64, adam, GradSync::kEager, LossReduction::kSum,
                            NormType::kL2, /*tied=*/true});
        variants.push_back({f64, adam, GradSync::kDeferred, LossReduction::kSum,
                            NormType::kInf});
        variants.push_back({f64, adam, GradSync::kEager,
                            LossReduction::kSampleMean, NormType::kInf,
                            /*tied=*/true});
        int n = 0;
        for (const Variant& v : variants) {
          TALLY_RETURN_IF_ERROR(CheckVariant(*engine, *reference, v,
                                             absl::StrCat("m", n++), moe));
        }
        TALLY_RETURN_IF_ERROR(
            CheckCheckpointsAcrossMeshes(*engine, *reference, "m0", env));
        // FLOAT32: SGD, and AdamW with its default eps.
        TALLY_RETURN_IF_ERROR(
            CheckVariant(*engine, *reference,
                         {DType::kFloat32, OptimizerKind::kSgd,
                          GradSync::kDeferred, LossReduction::kSampleMean},
                         "fp32_sgd", moe));
        TALLY_RETURN_IF_ERROR(
            CheckVariant(*engine, *reference,
                         {DType::kFloat32, OptimizerKind::kAdamW,
                          GradSync::kEager, LossReduction::kTokenMean},
                         "fp32_adamw", moe));
        if (!GetParam().large_model) return absl::OkStatus();
        // 4 layers of hidden 128 over kScheduleSteps steps, each with its
        // own learning rate, weight decay, betas and max_grad_norm.
        return CheckVariant(
            *engine, *reference,
            {f64, adam, GradSync::kEager, LossReduction::kTokenMean,
             NormType::kL2, /*tied=*/false, /*layers=*/4, /*large=*/true,
             kScheduleSteps},
            "large", moe);
      });
}

// The staged reduction of the reference design, one collective per
// parameter and dimension: squares summed over tp, dp_shard and ep where the
// parameter is sharded, nothing over replicas. Test-only.
absl::StatusOr<double> StagedL2Norm(CausalLm& model, const EngineGroups& g) {
  double total = 0;
  for (const Parameter& p : model.parameters()) {
    torch::Tensor sq =
        p.tensor.grad().to(torch::kFloat64).pow(2).sum().reshape({1});
    if (p.placements.at(MeshDim::kDpShard).is_shard()) {
      TALLY_RETURN_IF_ERROR(g.dp_shard->AllReduce(sq, ReduceOp::kSum));
    }
    if (p.placements.at(MeshDim::kTp).is_shard()) {
      TALLY_RETURN_IF_ERROR(g.tp->AllReduce(sq, ReduceOp::kSum));
    }
    if (p.placements.at(MeshDim::kEp).is_shard()) {
      TALLY_RETURN_IF_ERROR(g.ep->AllReduce(sq, ReduceOp::kSum));
    }
    total += sq.item<double>();
  }
  return std::sqrt(total);
}

// Sets every gradient to this rank's shard of `full(p)`.
template <typename Fn>
void SetGradients(CausalLm& model, Fn full) {
  for (Parameter& p : model.parameters()) {
    p.tensor.mutable_grad() = model.LocalShard(p, full(p));
  }
}

// Every rank sets its gradients to 2^rank before a DEFERRED OptimStep sums
// them: SGD's update then reads back which ranks each sum covered. Expert
// gradients must sum over the ranks with this rank's ep coordinate in every
// dp_replicate and ep block (never over ep); dense ones over dp_replicate x
// cp. The groups are enumerated here from the mesh layout itself.
absl::Status CheckRankEncodedReduction(Engine& engine, const RankEnv& env) {
  ModelSpec spec = Spec("r", DType::kFloat64, OptimizerKind::kSgd, true);
  spec.default_adam.weight_decay = 0;
  spec.grad_sync = GradSync::kDeferred;
  TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
  CausalLm& model = *EngineTestPeer::Model(engine, "r").value();
  TALLY_RETURN_IF_ERROR(
      engine.ForwardBackward("r", {MakeSamples(spec.config.vocab_size, {5}, 8)})
          .status());
  for (Parameter& p : model.parameters()) {
    p.tensor.mutable_grad().fill_(std::ldexp(1.0, env.rank));
  }
  const std::vector<torch::Tensor> before = testing::ParameterValues(model);
  OptimStepArgs args;
  args.max_grad_norm = 0;  // no clipping
  TALLY_ASSIGN_OR_RETURN(OptimStepResult step, engine.OptimStep("r", args));
  EXPECT_EQ(step.clip_coef, 1.0);

  const MeshShape& shape = engine.mesh().shape();
  auto coords = [&](int rank) {
    // Row-major pp x dp_replicate x dp_shard x cp x tp, tp fastest.
    const int tp = rank % shape.tp, cp = rank / shape.tp % shape.cp;
    const int dp_shard = rank / (shape.tp * shape.cp) % shape.dp_shard;
    const int data = dp_shard * shape.cp + cp;
    return std::array<int, 4>{tp, cp, dp_shard, data % shape.ep};
  };
  const auto me = coords(env.rank);
  double expert_sum = 0, dense_sum = 0;
  for (int r = 0; r < env.world_size; ++r) {
    const auto other = coords(r);
    if (other[0] != me[0]) continue;  // tp peers hold other shards
    if (other[3] == me[3]) expert_sum += std::ldexp(1.0, r);
    if (other[2] == me[2]) dense_sum += std::ldexp(1.0, r);
  }
  for (size_t i = 0; i < before.size(); ++i) {
    const Parameter& p = model.parameters()[i];
    const double sum = p.is_expert ? expert_sum : dense_sum;
    torch::Tensor want = before[i] - step.learning_rate * sum / step.normalizer;
    EXPECT_LT(RelativeDiff(p.tensor, want), 1e-12) << p.name;
  }
  return absl::OkStatus();
}

// The dispatch's collectives over ep are a fixed sequence whatever the
// routing: per micro-batch one all-reduce (MAX) of the token count, and per
// MoE layer an all-gather and a reduce-scatter forward and one of each
// backward, with the same payload on every rank (the tokens padded equal).
absl::Status CheckDispatchCollectives(Engine& engine) {
  Communicator& ep = *engine.groups().ep;
  if (ep.size() == 1) return absl::OkStatus();
  ModelSpec spec = Spec("d", DType::kFloat64, OptimizerKind::kSgd, true);
  TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
  ep.stats().Reset();
  // Uneven: one data rank holds 40 tokens, another a single one.
  TALLY_ASSIGN_OR_RETURN(
      ForwardBackwardResult result,
      engine.ForwardBackward(
          "d", {MakeSamples(spec.config.vocab_size, {40, 1}, 9)}));
  const int64_t micro_batches =
      static_cast<int64_t>(result.metrics["micro_batches"]);
  const int64_t layers = spec.config.num_hidden_layers;
  EXPECT_EQ(ep.stats().Get(CommOp::kAllReduce).calls, micro_batches);
  EXPECT_EQ(ep.stats().Get(CommOp::kAllGather).calls,
            2 * layers * micro_batches);
  EXPECT_EQ(ep.stats().Get(CommOp::kReduceScatter).calls,
            2 * layers * micro_batches);
  torch::Tensor bytes = torch::tensor(
      {static_cast<double>(ep.stats().Get(CommOp::kAllGather).bytes),
       static_cast<double>(ep.stats().Get(CommOp::kReduceScatter).bytes)},
      torch::kFloat64);
  TALLY_ASSIGN_OR_RETURN(torch::Tensor all, ep.AllGather(bytes));
  all = all.view({ep.size(), 2});
  for (int r = 1; r < ep.size(); ++r) {
    EXPECT_TRUE(torch::equal(all[r], all[0])) << "ep rank " << r;
  }
  return engine.DeleteModel("d").status();
}

class MultiRankNormTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(MultiRankNormTest, OneCollectiveEqualsTheStagedReduction) {
  const MeshShape shape = GetParam().shape;
  const bool moe = GetParam().moe;
  testing::RunOnRanks(
      shape.world_size(), [&](const RankEnv& env) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(auto engine,
                               testing::CreateRankEngine(shape, env, {}));
        const Mesh& mesh = engine->mesh();
        ModelSpec spec = Spec("n", DType::kFloat64, OptimizerKind::kAdamW, moe);
        TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
        CausalLm& model = *EngineTestPeer::Model(*engine, "n").value();
        Communicator& world = engine->world();

        // All-ones oracle: sqrt of the logical numel on every mesh.
        SetGradients(model, [](const Parameter& p) {
          return torch::ones(p.full_shape, torch::kFloat64);
        });
        TALLY_ASSIGN_OR_RETURN(GradNorm ones,
                               ComputeGlobalGradNorm(model.parameters(), mesh,
                                                     world, NormType::kL2));
        EXPECT_LT(
            RelativeDiff(ones.total,
                         std::sqrt(static_cast<double>(model.NumParameters()))),
            1e-14);
        // Each slot counts its logical numel once.
        const LlamaConfig& c = spec.config;
        const double expert_numel =
            moe ? static_cast<double>(c.num_hidden_layers *
                                      c.num_local_experts * 3 * c.hidden_size *
                                      c.intermediate_size)
                : 0.0;
        EXPECT_LT(RelativeDiff(ones.expert, std::sqrt(expert_numel)), 1e-14);
        EXPECT_LT(RelativeDiff(ones.dense,
                               std::sqrt(model.NumParameters() - expert_numel)),
                  1e-14);

        // Random full gradients (same seed on every rank): one collective,
        // equal to the staged reduction and to the norm of the full tensors.
        torch::manual_seed(5);
        std::vector<torch::Tensor> full;
        for (const Parameter& p : model.parameters()) {
          full.push_back(torch::randn(p.full_shape, torch::kFloat64));
        }
        size_t i = 0;
        SetGradients(model, [&](const Parameter&) { return full[i++]; });
        world.stats().Reset();
        TALLY_ASSIGN_OR_RETURN(
            GradNorm l2, ComputeGlobalGradNorm(model.parameters(), mesh, world,
                                               NormType::kL2));
        EXPECT_EQ(world.stats().TotalCalls(), 1);
        TALLY_ASSIGN_OR_RETURN(double staged,
                               StagedL2Norm(model, engine->groups()));
        EXPECT_LT(RelativeDiff(l2.total, staged), 1e-12);
        torch::Tensor all = torch::cat([&] {
          std::vector<torch::Tensor> flat;
          for (const auto& t : full) flat.push_back(t.flatten());
          return flat;
        }());
        EXPECT_LT(RelativeDiff(l2.total, all.norm().item<double>()), 1e-12);
        TALLY_ASSIGN_OR_RETURN(
            GradNorm inf, ComputeGlobalGradNorm(model.parameters(), mesh, world,
                                                NormType::kInf));
        EXPECT_EQ(inf.total, all.abs().max().item<double>());

        // A NaN on the last rank only (possibly in a replica the norm does not
        // count) makes every rank skip with nothing changed.
        TALLY_RETURN_IF_ERROR(
            engine
                ->ForwardBackward(
                    "n", {MakeSamples(spec.config.vocab_size, {9, 4, 2, 7}, 3)})
                .status());
        const std::vector<torch::Tensor> before =
            testing::ParameterValues(model);
        if (env.rank == env.world_size - 1) {
          model.parameters().back().tensor.mutable_grad().view({-1})[0] = NAN;
        }
        TALLY_ASSIGN_OR_RETURN(OptimStepResult skipped,
                               engine->OptimStep("n", {}));
        EXPECT_TRUE(skipped.skipped);
        EXPECT_TRUE(std::isnan(skipped.grad_norm));
        const std::vector<torch::Tensor> after =
            testing::ParameterValues(model);
        for (size_t k = 0; k < before.size(); ++k) {
          EXPECT_TRUE(torch::equal(before[k], after[k])) << k;
        }

        if (moe) {
          TALLY_RETURN_IF_ERROR(CheckDispatchCollectives(*engine));
          return CheckRankEncodedReduction(*engine, env);
        }
        // The training state per rank shrinks as 1/dp_shard (up to padding).
        TALLY_RETURN_IF_ERROR(
            engine
                ->ForwardBackward(
                    "n", {MakeSamples(spec.config.vocab_size, {9, 4}, 4)})
                .status());
        TALLY_ASSIGN_OR_RETURN(OptimStepResult stepped,
                               engine->OptimStep("n", {}));
        const double full_bytes =
            static_cast<double>(model.NumParameters()) * sizeof(double);
        const double share = 1.0 / (shape.dp_shard * shape.tp);
        for (const char* key : {"rank_param_bytes", "rank_grad_bytes"}) {
          EXPECT_GE(stepped.metrics[key], full_bytes * share) << key;
          EXPECT_LT(stepped.metrics[key], full_bytes * share * 1.3 + 4096)
              << key;
        }
        EXPECT_EQ(stepped.metrics["rank_optimizer_bytes"],
                  2 * stepped.metrics["rank_param_bytes"]);
        return absl::OkStatus();
      });
}

const auto kMeshes = ::testing::Values(
    MeshCase{"dp_replicate2", Shape(2, 1, 1)},
    MeshCase{"dp_shard2", Shape(1, 2, 1)}, MeshCase{"tp2", Shape(1, 1, 2)},
    MeshCase{"dp_shard2_tp2", Shape(1, 2, 2), false, /*large_model=*/true},
    MeshCase{"dp_replicate2_dp_shard2_tp2", Shape(2, 2, 2), false,
             /*large_model=*/true},
    MeshCase{"cp2", Shape(1, 1, 1, 2)}, MeshCase{"cp4", Shape(1, 1, 1, 4)},
    MeshCase{"cp2_dp_shard2", Shape(1, 2, 1, 2)},
    MeshCase{"cp2_tp2", Shape(1, 1, 2, 2)},
    MeshCase{"dp_replicate2_cp2_tp2", Shape(2, 1, 2, 2)},
    MeshCase{"ep2", Shape(1, 2, 1, 1, 2), true},
    MeshCase{"ep4", Shape(1, 4, 1, 1, 4), true},
    MeshCase{"ep2_tp2", Shape(1, 2, 2, 1, 2), true},
    MeshCase{"ep2_dp_replicate2", Shape(2, 2, 1, 1, 2), true},
    MeshCase{"ep2_cp2", Shape(1, 1, 1, 2, 2), true},
    // Expert replicas (ranks 0, 2) where dense parameters have none.
    MeshCase{"ep2_dp_shard4", Shape(1, 4, 1, 1, 2), true},
    // Experts replicated over the data ranks, each with its own tokens.
    MeshCase{"moe_dp_shard2", Shape(1, 2, 1), true});

std::string MeshName(const ::testing::TestParamInfo<MeshCase>& info) {
  return info.param.name;
}

INSTANTIATE_TEST_SUITE_P(Meshes, MultiRankNormTest, kMeshes, MeshName);

INSTANTIATE_TEST_SUITE_P(Meshes, MultiRankGoldenTest, kMeshes, MeshName);

// Pipeline parallelism: tied and untied embeddings, both reductions and
// both norms across the variants (fewer on the 8-rank meshes, for CI time).
class PipelineGoldenTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(PipelineGoldenTest, EqualsTheSingleDeviceRun) {
  const MeshShape shape = GetParam().shape;
  const bool moe = GetParam().moe;
  const int64_t layers = shape.pp > 2 ? 4 : 2;
  const bool small = shape.world_size() <= 4;
  testing::RunOnRanks(
      shape.world_size(), [&](const RankEnv& env) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(GoldenEngines engines,
                               CreateGoldenEngines(shape, env));
        std::unique_ptr<Engine>& engine = engines.mesh;
        std::unique_ptr<Engine>& reference = engines.reference;
        const DType f64 = DType::kFloat64;
        const OptimizerKind adam = OptimizerKind::kAdamW;
        std::vector<Variant> variants = {
            {f64, adam, GradSync::kEager, LossReduction::kTokenMean,
             NormType::kL2, true, layers},
            {f64, adam, GradSync::kDeferred, LossReduction::kSampleMean,
             NormType::kInf, false, layers}};
        if (small) {
          variants.push_back({f64, adam, GradSync::kEager,
                              LossReduction::kSampleMean, NormType::kInf, true,
                              layers});
          variants.push_back({f64, adam, GradSync::kDeferred,
                              LossReduction::kTokenMean, NormType::kL2, false,
                              layers});
          variants.push_back({DType::kFloat32, OptimizerKind::kSgd,
                              GradSync::kDeferred, LossReduction::kSampleMean,
                              NormType::kL2, true, layers});
        }
        int n = 0;
        for (const Variant& v : variants) {
          TALLY_RETURN_IF_ERROR(CheckVariant(*engine, *reference, v,
                                             absl::StrCat("p", n++), moe));
        }
        // forward_only: the activations flow forward only, and the last
        // stage's results reach every rank.
        ForwardBackwardArgs forward{Calls()[1], LossReduction::kSampleMean};
        forward.forward_only = true;
        forward.return_logprobs = true;
        TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult got,
                               engine->ForwardBackward("p0", forward));
        TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult want,
                               reference->ForwardBackward("p0", forward));
        EXPECT_LT(RelativeDiff(got.loss_mean, want.loss_mean), 1e-10);
        EXPECT_EQ(got.window.calls, 0);
        for (size_t i = 0; i < want.samples.size(); ++i) {
          for (size_t t = 0; t < want.samples[i].logprobs.size(); ++t) {
            EXPECT_NEAR(got.samples[i].logprobs[t], want.samples[i].logprobs[t],
                        1e-9);
          }
        }
        return CheckCheckpointsAcrossMeshes(*engine, *reference, "p0", env);
      });
}

const auto kPipelineMeshes = ::testing::Values(
    MeshCase{"pp2", PipelineShape(2)}, MeshCase{"pp4", PipelineShape(4)},
    MeshCase{"pp2_dp_shard2", PipelineShape(2, 2)},
    // Replica sums (overlapped with backward in EAGER) before the tied
    // embedding's stage sum.
    MeshCase{"pp2_dp_replicate2", Shape(2, 1, 1, 1, 1, 2)},
    MeshCase{"pp2_tp2", PipelineShape(2, 1, 2)},
    MeshCase{"pp2_dp_shard2_tp2", PipelineShape(2, 2, 2)},
    // A MoE model: each stage dispatches its own layers' tokens over ep, and
    // the load-balancing term flows to the last stage with the activations.
    MeshCase{"pp2_ep2_moe", PipelineShape(2, 2, 1, 1, 2), true},
    // The composite runs on 8 ranks: pp x dp_shard x tp with a MoE model at
    // ep = 2, and pp x dp_shard x cp.
    MeshCase{"pp2_dp_shard2_tp2_ep2_moe", PipelineShape(2, 2, 2, 1, 2), true},
    MeshCase{"pp2_dp_shard2_cp2", PipelineShape(2, 2, 1, 2)});

INSTANTIATE_TEST_SUITE_P(Meshes, PipelineGoldenTest, kPipelineMeshes, MeshName);

// The RL losses obey the window rule like cross-entropy: every loss under
// every reduction, three losses mixed in each window, signed weights, ratios
// inside and outside the clip range; losses, per-token losses, policy
// statistics, gradients, norm and update equal the single device's on the
// meshes that split a sample's tokens (cp) and its samples (dp_shard), both
// with tp.
class PolicyLossGoldenTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(PolicyLossGoldenTest, EqualsTheSingleDeviceRun) {
  const MeshShape shape = GetParam().shape;
  testing::RunOnRanks(
      shape.world_size(), [&](const RankEnv& env) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(GoldenEngines engines,
                               CreateGoldenEngines(shape, env));
        int n = 0;
        for (LossReduction reduction :
             {LossReduction::kTokenMean, LossReduction::kSampleMean,
              LossReduction::kSum}) {
          Variant v{DType::kFloat64, OptimizerKind::kAdamW, GradSync::kEager,
                    reduction};
          v.steps = 2;
          v.policy_losses = true;
          TALLY_RETURN_IF_ERROR(CheckVariant(*engines.mesh, *engines.reference,
                                             v, absl::StrCat("rl", n++),
                                             /*moe=*/false));
        }
        return absl::OkStatus();
      });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, PolicyLossGoldenTest,
    ::testing::Values(MeshCase{"dp_shard2_tp2", Shape(1, 2, 2)},
                      MeshCase{"cp2_tp2", Shape(1, 1, 2, 2)}),
    MeshName);

// The families' features on meshes that split them (FamilyConfig): q/k/v
// biases shard with their columns over tp and dp_shard, the o bias and the
// q/k norms stay replicated over tp (the norms' gradients summed over it),
// sliding windows see positions across cp blocks and pipeline stages; tied
// embeddings, as the small Qwens have, and untied. The untied variant also
// recomputes its layers in backward, so their collectives (tp, dp_shard
// gathers, cp) run again in backward.
class FamilyGoldenTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(FamilyGoldenTest, EqualsTheSingleDeviceRun) {
  const MeshCase& mesh = GetParam();
  testing::RunOnRanks(
      mesh.shape.world_size(), [&](const RankEnv& env) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(GoldenEngines engines,
                               CreateGoldenEngines(mesh.shape, env));
        std::unique_ptr<Engine>& engine = engines.mesh;
        std::unique_ptr<Engine>& reference = engines.reference;
        const DType f64 = DType::kFloat64;
        const OptimizerKind adam = OptimizerKind::kAdamW;
        const std::vector<Variant> variants = {
            {f64, adam, GradSync::kEager, LossReduction::kTokenMean,
             NormType::kL2, /*tied=*/true, /*layers=*/2, /*large=*/false,
             /*steps=*/2, mesh.family},
            {f64, adam, GradSync::kDeferred, LossReduction::kSampleMean,
             NormType::kInf, /*tied=*/true, 2, false, 1, mesh.family},
            {f64, adam, GradSync::kEager, LossReduction::kSum, NormType::kL2,
             /*tied=*/false, 2, false, 1, mesh.family,
             /*activation_checkpointing=*/true}};
        int n = 0;
        for (const Variant& v : variants) {
          TALLY_RETURN_IF_ERROR(CheckVariant(*engine, *reference, v,
                                             absl::StrCat("f", n++), false));
        }
        return CheckCheckpointsAcrossMeshes(*engine, *reference, "f0", env);
      });
}

INSTANTIATE_TEST_SUITE_P(
    Families, FamilyGoldenTest,
    ::testing::Values(
        MeshCase{"dp_shard2_tp2_qwen2", Shape(1, 2, 2), false, false, "qwen2"},
        MeshCase{"dp_shard2_tp2_qwen3", Shape(1, 2, 2), false, false, "qwen3"},
        MeshCase{"pp2_tp2_qwen2", PipelineShape(2, 1, 2), false, false,
                 "qwen2"},
        MeshCase{"pp2_tp2_qwen3", PipelineShape(2, 1, 2), false, false,
                 "qwen3"},
        MeshCase{"cp2_qwen3", Shape(1, 1, 1, 2), false, false, "qwen3"}),
    MeshName);

// ZeRO stages 1 and 2: every reduction under both syncs, both norms, tied and
// untied, SGD and AdamW in fp32, over two windows with changing
// hyperparameters (so the gathered copies must follow each step) and with
// several micro-batches per call; then checkpoints that move between the
// stages.
class ZeroStageGoldenTest : public ::testing::TestWithParam<MeshCase> {};

// A checkpoint saved under this engine's stage loads under the two others,
// and one saved under stage 3 loads under this one: each loaded model holds
// the saved shards bitwise and takes the single device's next step.
absl::Status CheckCheckpointsAcrossStages(Engine& engine, Engine& reference,
                                          const RankEnv& env, bool moe) {
  const ZeroStage stage = engine.zero_stage();
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "tally_zero_", env.master_port);
  ModelSpec spec = Spec("saved", DType::kFloat64, OptimizerKind::kAdamW, moe);
  TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
  TALLY_RETURN_IF_ERROR(reference.CreateModel(spec).status());
  auto train = [&](Engine& e, const std::string& id) -> absl::Status {
    for (const std::vector<Sample>& call : Calls()) {
      TALLY_RETURN_IF_ERROR(e.ForwardBackward(id, {call}).status());
    }
    return e.OptimStep(id, {}).status();
  };
  TALLY_RETURN_IF_ERROR(train(engine, "saved"));
  TALLY_RETURN_IF_ERROR(train(reference, "saved"));
  TALLY_RETURN_IF_ERROR(engine.SaveCheckpoint("saved", dir).status());
  TALLY_RETURN_IF_ERROR(train(reference, "saved"));
  CausalLm& want = *EngineTestPeer::Model(reference, "saved").value();
  int n = 0;
  for (ZeroStage load_stage : {ZeroStage::kOptimizerState,
                               ZeroStage::kGradients, ZeroStage::kParameters}) {
    if (load_stage == stage) continue;
    // Saved under `stage`, loaded under `load_stage`; then (n = 1 only)
    // saved again under `load_stage`, loaded back under `stage`.
    for (bool back : {false, true}) {
      if (back && load_stage != ZeroStage::kParameters) continue;
      SCOPED_TRACE(absl::StrCat("saved under ", static_cast<int>(stage),
                                ", loaded under ", static_cast<int>(load_stage),
                                back ? ", saved, loaded back" : ""));
      const std::string id = absl::StrCat("loaded", n++);
      EngineTestPeer::SetZeroStage(engine, back ? stage : load_stage);
      spec.model_id = id;
      TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
      const std::string from = back ? absl::StrCat(dir, "_stage3") : dir;
      TALLY_RETURN_IF_ERROR(engine.LoadCheckpoint(id, from, true).status());
      CausalLm& saved = *EngineTestPeer::Model(engine, "saved").value();
      CausalLm& loaded = *EngineTestPeer::Model(engine, id).value();
      for (const Parameter& p : loaded.parameters()) {
        EXPECT_TRUE(torch::equal(p.tensor, saved.Find(p.name)->tensor))
            << p.name;
      }
      if (!back && load_stage == ZeroStage::kParameters) {
        TALLY_RETURN_IF_ERROR(
            engine.SaveCheckpoint(id, absl::StrCat(dir, "_stage3")).status());
      }
      TALLY_RETURN_IF_ERROR(train(engine, id));
      for (const Parameter& p : loaded.parameters()) {
        EXPECT_LT(RelativeDiff(p.tensor,
                               loaded.LocalShard(p, want.Find(p.name)->tensor)),
                  1e-10)
            << p.name;
      }
    }
  }
  EngineTestPeer::SetZeroStage(engine, stage);
  return absl::OkStatus();
}

TEST_P(ZeroStageGoldenTest, EqualsTheSingleDeviceRun) {
  const MeshCase& mesh = GetParam();
  RunGolden(
      mesh,
      [&](Engine& engine, Engine& reference,
          const RankEnv& env) -> absl::Status {
        const DType f64 = DType::kFloat64;
        const OptimizerKind adam = OptimizerKind::kAdamW;
        const int64_t layers = 2;
        const bool pp = mesh.shape.pp > 1;
        std::vector<Variant> variants;
        for (GradSync sync : {GradSync::kEager, GradSync::kDeferred}) {
          variants.push_back({f64, adam, sync, LossReduction::kTokenMean,
                              NormType::kL2, /*tied=*/false, layers,
                              /*large=*/false, /*steps=*/2});
          variants.push_back({f64, adam, sync, LossReduction::kSampleMean,
                              NormType::kInf, /*tied=*/true, layers});
          variants.push_back({f64, adam, sync, LossReduction::kSum,
                              NormType::kL2,
                              /*tied=*/!pp, layers});
        }
        variants.push_back({DType::kFloat32, OptimizerKind::kSgd,
                            GradSync::kDeferred, LossReduction::kSampleMean});
        variants.push_back({DType::kFloat32, adam, GradSync::kEager,
                            LossReduction::kTokenMean});
        int n = 0;
        for (const Variant& v : variants) {
          TALLY_RETURN_IF_ERROR(CheckVariant(engine, reference, v,
                                             absl::StrCat("z", n++), mesh.moe));
        }
        return CheckCheckpointsAcrossStages(engine, reference, env, mesh.moe);
      });
}

// Stages 1 and 2 on dp_shard alone and with tp, and with each other
// dimension: dp_replicate (HSDP: the shard's gradient then sums over the
// replicas), cp, ep (experts are not dp_shard-sharded) and pp (the tied
// embedding's copies on two stages).
INSTANTIATE_TEST_SUITE_P(
    Stages, ZeroStageGoldenTest,
    ::testing::Values(MeshCase{"zero1_dp_shard2", Shape(1, 2, 1), false, false,
                               nullptr, ZeroStage::kOptimizerState},
                      MeshCase{"zero2_dp_shard2", Shape(1, 2, 1), false, false,
                               nullptr, ZeroStage::kGradients},
                      MeshCase{"zero1_dp_shard2_tp2", Shape(1, 2, 2), false,
                               false, nullptr, ZeroStage::kOptimizerState},
                      MeshCase{"zero2_dp_shard2_tp2", Shape(1, 2, 2), false,
                               false, nullptr, ZeroStage::kGradients},
                      MeshCase{"zero1_dp_replicate2_dp_shard2", Shape(2, 2, 1),
                               false, false, nullptr,
                               ZeroStage::kOptimizerState},
                      MeshCase{"zero2_cp2_dp_shard2", Shape(1, 2, 1, 2), false,
                               false, nullptr, ZeroStage::kGradients},
                      MeshCase{"zero1_ep2_moe", Shape(1, 2, 1, 1, 2), true,
                               false, nullptr, ZeroStage::kOptimizerState},
                      MeshCase{"zero2_pp2_dp_shard2", PipelineShape(2, 2),
                               false, false, nullptr, ZeroStage::kGradients},
                      MeshCase{"zero1_pp2_dp_shard2", PipelineShape(2, 2),
                               false, false, nullptr,
                               ZeroStage::kOptimizerState}),
    MeshName);

// bf16 mixed precision on meshes that split it (bf16 gathers, tp and cp
// collectives through float32 sums on Gloo, pipeline sends): the mesh's
// bf16 model equals the single device's bf16 model within the distance
// between the single device's bf16 and float32 models on the same data —
// losses of each call, the norm, and the loss after the step.
class MixedPrecisionGoldenTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(MixedPrecisionGoldenTest, EqualsTheSingleDeviceRunWithinBf16Rounding) {
  RunGolden(
      GetParam(),
      [&](Engine& engine, Engine& reference, const RankEnv&) -> absl::Status {
        ModelSpec bf16 = Spec("bf16", DType::kBFloat16, OptimizerKind::kAdamW,
                              /*moe=*/false, /*tied=*/true, 2, false, "qwen3");
        ModelSpec f32 = bf16;
        f32.model_id = "f32";
        f32.dtype = DType::kFloat32;
        TALLY_RETURN_IF_ERROR(engine.CreateModel(bf16).status());
        TALLY_RETURN_IF_ERROR(reference.CreateModel(bf16).status());
        TALLY_RETURN_IF_ERROR(reference.CreateModel(f32).status());
        // [mesh bf16, single bf16, single f32] per measured quantity.
        std::vector<std::array<double, 3>> measured;
        auto measure = [&](auto fn) -> absl::Status {
          std::array<double, 3> values;
          int i = 0;
          for (auto [e, id] : {std::pair{&engine, "bf16"},
                               {&reference, "bf16"},
                               {&reference, "f32"}}) {
            TALLY_ASSIGN_OR_RETURN(values[i++], fn(*e, id));
          }
          measured.push_back(values);
          return absl::OkStatus();
        };
        for (const std::vector<Sample>& call : Calls()) {
          TALLY_RETURN_IF_ERROR(
              measure([&](Engine& e, const char* id) -> absl::StatusOr<double> {
                TALLY_ASSIGN_OR_RETURN(auto r, e.ForwardBackward(id, {call}));
                return r.loss_sum;
              }));
        }
        OptimStepArgs step;
        step.max_grad_norm = 0.05;
        TALLY_RETURN_IF_ERROR(
            measure([&](Engine& e, const char* id) -> absl::StatusOr<double> {
              TALLY_ASSIGN_OR_RETURN(auto r, e.OptimStep(id, step));
              return r.grad_norm;
            }));
        TALLY_RETURN_IF_ERROR(
            measure([&](Engine& e, const char* id) -> absl::StatusOr<double> {
              ForwardBackwardArgs eval{Calls()[1]};
              eval.forward_only = true;
              TALLY_ASSIGN_OR_RETURN(auto r, e.ForwardBackward(id, eval));
              return r.loss_sum;
            }));
        double mesh_distance = 0, dtype_distance = 0;
        for (const auto& [mesh_bf16, bf16, f32] : measured) {
          mesh_distance =
              std::max(mesh_distance, RelativeDiff(mesh_bf16, bf16));
          dtype_distance = std::max(dtype_distance, RelativeDiff(bf16, f32));
        }
        EXPECT_GT(dtype_distance, 0) << "bf16 computed in float32?";
        EXPECT_LE(mesh_distance, dtype_distance)
            << "mesh vs single bf16 " << mesh_distance
            << ", single bf16 vs float32 " << dtype_distance;
        return absl::OkStatus();
      });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, MixedPrecisionGoldenTest,
    ::testing::Values(MeshCase{"dp_shard2_tp2", Shape(1, 2, 2)},
                      MeshCase{"pp2_tp2", PipelineShape(2, 1, 2)},
                      MeshCase{"dp_replicate2_cp2", Shape(2, 1, 1, 2)},
                      MeshCase{"zero1_dp_shard2_tp2", Shape(1, 2, 2), false,
                               false, nullptr, ZeroStage::kOptimizerState},
                      MeshCase{"zero2_dp_shard2_tp2", Shape(1, 2, 2), false,
                               false, nullptr, ZeroStage::kGradients}),
    MeshName);

// The bug this design rules out: clipping each stage by its own norm. A
// test-only engine variant does exactly that on pp = 2 (each stage measures
// and clips its gradients alone, then steps unclipped); the golden
// comparison that the engine's own step passes must reject it.
TEST(PipelineGoldenTest, ClippingPerStageFailsTheGoldenComparison) {
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(
        auto engine, testing::CreateRankEngine(PipelineShape(2), env, {}));
    TALLY_ASSIGN_OR_RETURN(auto reference, Engine::CreateSingleRank({}));
    // SGD: an update proportional to the clipped gradient (AdamW would
    // largely cancel a per-stage scale).
    ModelSpec spec =
        Spec("m", DType::kFloat64, OptimizerKind::kSgd, false, /*tied=*/true);
    spec.grad_sync = GradSync::kEager;
    for (const char* id : {"global", "per_stage"}) {
      spec.model_id = id;
      TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    }
    TALLY_RETURN_IF_ERROR(reference->CreateModel(spec).status());
    for (const std::vector<Sample>& call : Calls()) {
      for (const char* id : {"global", "per_stage"}) {
        TALLY_RETURN_IF_ERROR(engine->ForwardBackward(id, {call}).status());
      }
      TALLY_RETURN_IF_ERROR(
          reference->ForwardBackward("per_stage", {call}).status());
    }
    CausalLm& want = *EngineTestPeer::Model(*reference, "per_stage").value();
    const std::vector<torch::Tensor> initial = testing::ParameterValues(want);
    OptimStepArgs step;
    step.max_grad_norm = 0.05;  // far below the norm: clipping is active
    TALLY_RETURN_IF_ERROR(reference->OptimStep("per_stage", step).status());
    TALLY_RETURN_IF_ERROR(engine->OptimStep("global", step).status());

    CausalLm& per_stage = *EngineTestPeer::Model(*engine, "per_stage").value();
    TALLY_ASSIGN_OR_RETURN(auto stage_alone, MakeSingleRankCommunicator());
    TALLY_ASSIGN_OR_RETURN(
        ClipResult clip,
        ComputeClip(per_stage.parameters(),
                    engine->GetModel("per_stage")->window.tokens,
                    engine->mesh(), *stage_alone, NormType::kL2,
                    *step.max_grad_norm));
    for (Parameter& p : per_stage.parameters()) {
      p.tensor.mutable_grad().mul_(clip.clip_coef);
    }
    OptimStepArgs unclipped;
    unclipped.max_grad_norm = 0;
    TALLY_RETURN_IF_ERROR(engine->OptimStep("per_stage", unclipped).status());

    // The updates (step minus the shared initial values) against the
    // single-device update: SGD's update is the clipped gradient times lr.
    std::map<std::string, torch::Tensor> want_update;
    for (size_t i = 0; i < initial.size(); ++i) {
      const Parameter& p = want.parameters()[i];
      want_update[p.name] = p.tensor.detach() - initial[i];
    }
    double global_diff = 0, per_stage_diff = 0;
    for (const auto& [id, diff] :
         {std::pair<const char*, double*>{"global", &global_diff},
          {"per_stage", &per_stage_diff}}) {
      CausalLm& got = *EngineTestPeer::Model(*engine, id).value();
      for (const Parameter& p : got.parameters()) {
        const torch::Tensor start = got.LocalShard(
            p, initial[want.Find(p.name) - want.parameters().data()]);
        *diff = std::max(*diff,
                         RelativeDiff(p.tensor.detach() - start,
                                      got.LocalShard(p, want_update[p.name])));
      }
    }
    EXPECT_LT(global_diff, 1e-9);
    // Each stage's own norm is below the global one, so each clipped less:
    // every stage's update is off by far more than the golden tolerance.
    EXPECT_GT(per_stage_diff, 1e-2);
    return absl::OkStatus();
  });
}

// One HF directory whatever pp: written by a pp = 2 deployment, it loads on
// a single rank and on pp = 4, which then take the same step. A model with
// fewer layers than stages is refused, naming the field.
TEST(PipelineCheckpointTest, SavedWithPp2LoadsWithPp1AndPp4) {
  ModelSpec spec = TinySpec("c", DType::kFloat64, OptimizerKind::kAdamW);
  spec.config = testing::TinyConfig(/*tie_word_embeddings=*/true, 4);
  // Both launches' ranks are children of this process.
  auto dir = [] {
    return absl::StrCat(::testing::TempDir(), "tally_pp2_", getppid());
  };
  const std::vector<std::vector<Sample>> calls = Calls();
  testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(
        auto engine, testing::CreateRankEngine(PipelineShape(2), env, {}));
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    for (const auto& call : calls) {
      TALLY_RETURN_IF_ERROR(engine->ForwardBackward("c", {call}).status());
    }
    TALLY_RETURN_IF_ERROR(engine->OptimStep("c", {}).status());
    return engine->SaveCheckpoint("c", dir()).status();
  });
  testing::RunOnRanks(4, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(
        auto engine, testing::CreateRankEngine(PipelineShape(4), env, {}));
    TALLY_ASSIGN_OR_RETURN(auto reference, Engine::CreateSingleRank({}));
    ModelSpec too_deep = TinySpec("deep", DType::kFloat64, OptimizerKind::kSgd);
    absl::Status refused = engine->CreateModel(too_deep).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(refused.message(), "num_hidden_layers"))
        << refused;
    for (Engine* e : {engine.get(), reference.get()}) {
      TALLY_RETURN_IF_ERROR(e->CreateModel(spec).status());
      TALLY_RETURN_IF_ERROR(e->LoadCheckpoint("c", dir(), true).status());
    }
    CausalLm& model = *EngineTestPeer::Model(*engine, "c").value();
    CausalLm& ref_model = *EngineTestPeer::Model(*reference, "c").value();
    EXPECT_EQ(engine->GetModel("c")->step, 1);
    for (const Parameter& p : model.parameters()) {
      EXPECT_TRUE(torch::equal(p.tensor, ref_model.Find(p.name)->tensor))
          << p.name;
    }
    for (Engine* e : {engine.get(), reference.get()}) {
      for (const auto& call : calls) {
        TALLY_RETURN_IF_ERROR(e->ForwardBackward("c", {call}).status());
      }
    }
    TALLY_ASSIGN_OR_RETURN(OptimStepResult got, engine->OptimStep("c", {}));
    TALLY_ASSIGN_OR_RETURN(OptimStepResult want, reference->OptimStep("c", {}));
    EXPECT_LT(RelativeDiff(got.grad_norm, want.grad_norm), 1e-10);
    for (const Parameter& p : model.parameters()) {
      EXPECT_LT(RelativeDiff(p.tensor, ref_model.Find(p.name)->tensor), 1e-10)
          << p.name;
    }
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace tally
