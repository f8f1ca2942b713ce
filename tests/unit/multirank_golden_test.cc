// Golden tests of the multi-rank runtime: real rank processes on loopback,
// each running a multi-rank engine, and in the same process a single-rank
// engine on the same samples. Every rank checks its own shards against the
// matching shards of the single-device run: losses, gradients (EAGER),
// norm, clip coefficient and updated parameters.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runtime/distributed.h"
#include "runtime/engine.h"
#include "runtime/grad_norm.h"
#include "runtime/status.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::MakeSamples;
using testing::RelativeDiff;
using testing::TinySpec;

struct MeshCase {
  const char* name;
  MeshShape shape;
};

MeshShape Shape(int dp_replicate, int dp_shard, int tp, int cp = 1,
                int pp = 1) {
  MeshShape shape;
  shape.pp = pp;
  shape.dp_replicate = dp_replicate;
  shape.dp_shard = dp_shard;
  shape.tp = tp;
  shape.cp = cp;
  return shape;
}

struct Variant {
  DType dtype;
  OptimizerKind optimizer;
  GradSync sync;
  LossReduction reduction;
  NormType norm = NormType::kL2;
  bool tied = false;
  int64_t layers = 2;  // 4 for pp = 4
};

std::string VariantName(const Variant& v) {
  return absl::StrCat(DTypeName(v.dtype), "/", OptimizerName(v.optimizer), "/",
                      v.sync == GradSync::kEager ? "eager" : "deferred", "/",
                      ReductionName(v.reduction), "/",
                      v.norm == NormType::kInf ? "inf" : "l2",
                      v.tied ? "/tied" : "");
}

// This rank's engine of a deployment laid out as `shape`.
absl::StatusOr<std::unique_ptr<Engine>> RankEngine(
    const MeshShape& shape, const RankEnv& env, const EngineOptions& options) {
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
  TALLY_ASSIGN_OR_RETURN(auto groups,
                         ProcessGroups::Create(env, mesh, absl::Seconds(60)));
  return Engine::Create(options, mesh, std::move(groups));
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

// Checks one variant on this rank; gtest failures are reported by the rank.
absl::Status CheckVariant(Engine& engine, Engine& reference, const Variant& v,
                          const std::string& id) {
  SCOPED_TRACE(VariantName(v));
  const double tol = testing::GoldenTolerance(v.dtype);
  ModelSpec spec = TinySpec(id, v.dtype, v.optimizer);
  spec.config = testing::TinyConfig(v.tied, v.layers);
  spec.grad_sync = v.sync;
  if (v.dtype == DType::kFloat32 && v.optimizer == OptimizerKind::kAdamW) {
    spec.default_adam.eps = 1e-4;  // see accumulation_golden_test.cc
  }
  TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
  TALLY_RETURN_IF_ERROR(reference.CreateModel(spec).status());
  LlamaModel& model = *engine.model(id).value();
  LlamaModel& ref_model = *reference.model(id).value();

  for (const std::vector<Sample>& call : Calls()) {
    ForwardBackwardArgs args{call, v.reduction};
    args.return_logprobs = true;
    TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult got,
                           engine.ForwardBackward(id, args));
    TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult want,
                           reference.ForwardBackward(id, args));
    EXPECT_LT(RelativeDiff(got.loss_sum, want.loss_sum), tol);
    EXPECT_EQ(got.valid_tokens, want.valid_tokens);
    EXPECT_EQ(got.num_samples, want.num_samples);
    EXPECT_EQ(got.window.tokens, want.window.tokens);
    EXPECT_EQ(got.window.samples, want.window.samples);
    for (size_t i = 0; i < call.size(); ++i) {
      EXPECT_LT(RelativeDiff(got.samples[i].loss_sum, want.samples[i].loss_sum),
                tol + 1e-300);
      EXPECT_EQ(got.samples[i].logprobs.size(),
                want.samples[i].logprobs.size());
      const size_t n = std::min(got.samples[i].logprobs.size(),
                                want.samples[i].logprobs.size());
      for (size_t t = 0; t < n; ++t) {
        EXPECT_NEAR(got.samples[i].logprobs[t], want.samples[i].logprobs[t],
                    tol * 10);
      }
    }
  }
  // EAGER: summed over the replicas (dp_replicate x cp) after every call,
  // so this rank's gradient shard is the single-device gradient's shard.
  // DEFERRED: the replicas' local gradients sum to it (OptimStep does that
  // sum).
  // Under pp the two copies of a tied embedding likewise sum to it.
  Parameter* tied = model.SplitTiedEmbedding();
  const int tied_peer =
      model.first_stage() ? engine.groups().pp->size() - 1 : 0;
  for (Parameter& p : model.parameters()) {
    torch::Tensor got = p.tensor.grad().clone();
    if (v.sync == GradSync::kDeferred && engine.groups().replicas->size() > 1) {
      TALLY_RETURN_IF_ERROR(
          engine.groups().replicas->AllReduce(got, ReduceOp::kSum));
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

  OptimStepArgs step;
  step.max_grad_norm = 0.05;  // far below the norm: clipping is active
  step.norm_type = v.norm;
  if (engine.groups().pp->size() == engine.world().size() &&
      engine.world().size() > 1 && v.sync == GradSync::kEager) {
    // Negative check: clipping per stage (each rank of a pure pp mesh is a
    // stage) would use this rank's norm, which is not the global one, so
    // the golden comparison of the norm and clip coefficient rejects it.
    TALLY_ASSIGN_OR_RETURN(auto stage_group, MakeSingleRankCommunicator());
    TALLY_ASSIGN_OR_RETURN(
        GradNorm per_stage,
        ComputeGlobalGradNorm(model.parameters(), engine.mesh(), *stage_group,
                              v.norm));
    TALLY_ASSIGN_OR_RETURN(
        GradNorm global,
        ComputeGlobalGradNorm(ref_model.parameters(), reference.mesh(),
                              reference.world(), v.norm));
    if (v.norm == NormType::kL2) {
      EXPECT_GT(RelativeDiff(per_stage.total, global.total), 1e-3);
    } else {
      // INF: the MAX is on one stage; the others' per-stage norm is lower.
      TALLY_ASSIGN_OR_RETURN(
          auto all, engine.world().AllGather(
                        torch::tensor({per_stage.total}, torch::kFloat64)));
      EXPECT_GT(RelativeDiff(all.min().item<double>(), global.total), 1e-3);
    }
  }
  TALLY_ASSIGN_OR_RETURN(OptimStepResult got, engine.OptimStep(id, step));
  TALLY_ASSIGN_OR_RETURN(OptimStepResult want, reference.OptimStep(id, step));
  EXPECT_LT(RelativeDiff(got.grad_norm, want.grad_norm), tol);
  EXPECT_LT(RelativeDiff(got.clip_coef, want.clip_coef), tol);
  EXPECT_LT(got.clip_coef, 0.5);
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

  const double param_tol =
      v.dtype == DType::kFloat32 && v.optimizer == OptimizerKind::kAdamW ? 1e-4
                                                                         : tol;
  for (const Parameter& p : model.parameters()) {
    torch::Tensor want = model.LocalShard(p, ref_model.Find(p.name)->tensor);
    EXPECT_LT(RelativeDiff(p.tensor, want), param_tol) << p.name;
    // Replicas are bitwise identical: across dp_replicate and cp for
    // everything, across tp for what tp replicates.
    std::vector<Communicator*> replica_groups = {engine.groups().replicas};
    if (!p.placements.at(MeshDim::kTp).is_shard()) {
      replica_groups.push_back(engine.groups().tp);
    }
    for (Communicator* group : replica_groups) {
      if (group->size() == 1) continue;
      TALLY_ASSIGN_OR_RETURN(torch::Tensor copies,
                             group->AllGather(p.tensor.detach().flatten()));
      for (const torch::Tensor& copy : copies.chunk(group->size())) {
        EXPECT_TRUE(torch::equal(copy, p.tensor.detach().flatten())) << p.name;
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
  LlamaModel& model = *engine.model(id).value();
  LlamaModel& ref_model = *reference.model(id).value();
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
  testing::RunOnRanks(
      shape.world_size(), [&](const RankEnv& env) -> absl::Status {
        EngineOptions options;
        options.max_batch_tokens = 96;  // several micro-batches per call
        TALLY_ASSIGN_OR_RETURN(auto engine, RankEngine(shape, env, options));
        TALLY_ASSIGN_OR_RETURN(auto reference,
                               Engine::CreateSingleRank(options));
        int n = 0;
        for (GradSync sync : {GradSync::kEager, GradSync::kDeferred}) {
          for (LossReduction reduction :
               {LossReduction::kTokenMean, LossReduction::kSampleMean}) {
            TALLY_RETURN_IF_ERROR(CheckVariant(
                *engine, *reference,
                {DType::kFloat64, OptimizerKind::kAdamW, sync, reduction},
                absl::StrCat("m", n++)));
          }
        }
        TALLY_RETURN_IF_ERROR(
            CheckCheckpointsAcrossMeshes(*engine, *reference, "m0", env));
        // FLOAT32: SGD keeps every comparison at 1e-5; AdamW runs with eps 1e-4
        // (see accumulation_golden_test.cc for why).
        TALLY_RETURN_IF_ERROR(
            CheckVariant(*engine, *reference,
                         {DType::kFloat32, OptimizerKind::kSgd,
                          GradSync::kDeferred, LossReduction::kSampleMean},
                         "fp32_sgd"));
        return CheckVariant(*engine, *reference,
                            {DType::kFloat32, OptimizerKind::kAdamW,
                             GradSync::kEager, LossReduction::kTokenMean},
                            "fp32_adamw");
      });
}

// The staged reduction of the reference design, one collective per
// parameter and dimension: squares summed over tp and dp_shard where the
// parameter is sharded, nothing over replicas. Test-only.
absl::StatusOr<double> StagedL2Norm(LlamaModel& model, const EngineGroups& g) {
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
    total += sq.item<double>();
  }
  return std::sqrt(total);
}

// Sets every gradient to this rank's shard of `full(p)`.
template <typename Fn>
void SetGradients(LlamaModel& model, Fn full) {
  for (Parameter& p : model.parameters()) {
    p.tensor.mutable_grad() = model.LocalShard(p, full(p));
  }
}

class MultiRankNormTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(MultiRankNormTest, OneCollectiveEqualsTheStagedReduction) {
  const MeshShape shape = GetParam().shape;
  testing::RunOnRanks(
      shape.world_size(), [&](const RankEnv& env) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(auto engine, RankEngine(shape, env, {}));
        const Mesh& mesh = engine->mesh();
        ModelSpec spec = TinySpec("n", DType::kFloat64, OptimizerKind::kAdamW);
        TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
        LlamaModel& model = *engine->model("n").value();
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
    MeshCase{"dp_shard2_tp2", Shape(1, 2, 2)},
    MeshCase{"dp_replicate2_dp_shard2_tp2", Shape(2, 2, 2)},
    MeshCase{"cp2", Shape(1, 1, 1, 2)}, MeshCase{"cp4", Shape(1, 1, 1, 4)},
    MeshCase{"cp2_dp_shard2", Shape(1, 2, 1, 2)},
    MeshCase{"cp2_tp2", Shape(1, 1, 2, 2)},
    MeshCase{"dp_replicate2_cp2_tp2", Shape(2, 1, 2, 2)});

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
  const int64_t layers = shape.pp > 2 ? 4 : 2;
  const bool small = shape.world_size() <= 4;
  testing::RunOnRanks(
      shape.world_size(), [&](const RankEnv& env) -> absl::Status {
        EngineOptions options;
        options.max_batch_tokens = 96;
        TALLY_ASSIGN_OR_RETURN(auto engine, RankEngine(shape, env, options));
        TALLY_ASSIGN_OR_RETURN(auto reference,
                               Engine::CreateSingleRank(options));
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
          TALLY_RETURN_IF_ERROR(
              CheckVariant(*engine, *reference, v, absl::StrCat("p", n++)));
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
    MeshCase{"pp2", Shape(1, 1, 1, 1, 2)},
    MeshCase{"pp4", Shape(1, 1, 1, 1, 4)},
    MeshCase{"pp2_dp_shard2", Shape(1, 2, 1, 1, 2)},
    MeshCase{"pp2_tp2", Shape(1, 1, 2, 1, 2)},
    MeshCase{"pp2_dp_shard2_tp2", Shape(1, 2, 2, 1, 2)},
    // The composite run: every dimension that fits on 8 ranks but tp.
    MeshCase{"pp2_dp_shard2_cp2", Shape(1, 2, 1, 2, 2)});

INSTANTIATE_TEST_SUITE_P(Meshes, PipelineGoldenTest, kPipelineMeshes, MeshName);

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
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           RankEngine(Shape(1, 1, 1, 1, 2), env, {}));
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    for (const auto& call : calls) {
      TALLY_RETURN_IF_ERROR(engine->ForwardBackward("c", {call}).status());
    }
    TALLY_RETURN_IF_ERROR(engine->OptimStep("c", {}).status());
    return engine->SaveCheckpoint("c", dir()).status();
  });
  testing::RunOnRanks(4, [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           RankEngine(Shape(1, 1, 1, 1, 4), env, {}));
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
    LlamaModel& model = *engine->model("c").value();
    LlamaModel& ref_model = *reference->model("c").value();
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
