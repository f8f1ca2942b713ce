// bench_comm: the communication volume of one training step of tally's
// multi-rank runtime, measured from the Communicator counters of real rank
// processes, against the theoretical data-parallel / ZeRO-1/2/3 / Megatron
// volumes; and the parameter + gradient + optimizer bytes per rank as
// dp_shard grows, per ZeRO stage, against the seed's memory table. Reported,
// not timed: see docs/performance.md. One timed section: EAGER ForwardBackward
// on dp_replicate = 2 with the gradient buckets summed during backward
// (--overlap-grad-sync, the default) versus after it, launches of the two
// interleaved, the ratio of the medians.
//
//   build/bench/bench_comm   # or `make bench`; tables, then one JSON per row
//   build/bench/bench_comm --overlap-only   # just the timed section
//
// The binary is its own launcher: for each mesh it starts one copy of itself
// per rank through tally's local launcher (torchrun's RANK / WORLD_SIZE /
// MASTER_ADDR / MASTER_PORT), each rank builds a multi-rank Engine, and rank
// 0 writes its rows as JSON lines to a file the launcher then reads. The
// launcher turns the counted bytes into per-rank wire bytes and compares
// them with the theory.
//
// Flags (absl; --help lists them): --overlap-only. The launcher gives its
// ranks --rank-of-mesh=dp_replicate,dp_shard,tp or --rank-of-overlap, with
// --results=FILE; those are not for users.
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "base/log.h"
#include "base/status.h"
#include "bench/bench_main.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/mesh.h"
#include "runtime/train/optimizer.h"
#include "server/launcher.h"
#include "tests/testing/engine_test_peer.h"

ABSL_FLAG(bool, overlap_only, false,
          "run just the timed gradient-sync overlap section, not the meshes");
// A rank's command line, written by the launcher (LaunchRanks below).
ABSL_FLAG(std::string, rank_of_mesh, "",
          "internal, set by the launcher: run as a rank of the mesh "
          "dp_replicate,dp_shard,tp (each >= 1)");
ABSL_FLAG(bool, rank_of_overlap, false,
          "internal, set by the launcher: run as a rank of the overlap "
          "section");
ABSL_FLAG(std::string, results, "",
          "internal, set by the launcher: the file rank 0 appends its JSON "
          "rows to (required with --rank-of-mesh or --rank-of-overlap)");

namespace tally {
namespace {

using nlohmann::json;

constexpr char kUsage[] =
    "Every mesh's communication volume and model state per rank, then the "
    "timed gradient-sync overlap section.\n"
    "usage: bench_comm [--overlap-only]";

// What the launcher passes its ranks (the flags above): the mesh
// ("dp_replicate,dp_shard,tp") and the file rank 0 appends its JSON rows to,
// or a rank of the overlap section instead of a mesh.
constexpr char kMeshFlag[] = "--rank-of-mesh=";
constexpr char kResultsFlag[] = "--results=";
constexpr char kOverlapFlag[] = "--rank-of-overlap";

constexpr absl::Duration kRendezvousTimeout = absl::Seconds(60);
// A rank stuck in a collective dies of SIGALRM after this, and the launcher
// then stops its peers: a hung run fails instead of hanging `make bench`.
constexpr unsigned kRankDeadlineSeconds = 300;

constexpr int kSamplesPerCall = 8;  // divisible by every data-parallel size
constexpr int kTokensPerSample = 16;
constexpr int kCallsPerStep[] = {1, 4};
// A dp_shard-only mesh's model-state bytes may exceed total(1) / S by shard
// padding (zero for the embedded model, whose dims all divide by 4).
constexpr double kShardingTolerance = 0.01;
// Measured against a formula over the same bytes: equal up to rounding.
constexpr double kSeedTolerance = 1e-3;

// The overlap section: a model large enough for several buckets (4.5M
// parameters, 18 MB of fp32 gradients, in 4 MiB buckets) and few tokens per
// call (one 16-token sample per rank), so the sum is a visible part of a
// call. In one pair of rank processes, calls alternate off / on in ABBA
// order after a warm-up of each, so a drift of the machine's load hits both.
constexpr int kOverlapSamples = 2;
constexpr int kOverlapWarmupPairs = 1;
constexpr int kOverlapPairs = 24;
constexpr int64_t kOverlapBucketMb = 4;

MeshShape Shape(int dp_replicate, int dp_shard, int tp) {
  MeshShape shape;
  shape.dp_replicate = dp_replicate;
  shape.dp_shard = dp_shard;
  shape.tp = tp;
  return shape;
}

// The single rank is the baseline; dp_shard = 4 completes the 1/S series.
std::vector<MeshShape> BenchMeshes() {
  return {Shape(1, 1, 1), Shape(2, 1, 1), Shape(1, 2, 1), Shape(1, 1, 2),
          Shape(1, 2, 2), Shape(2, 2, 2), Shape(1, 4, 1)};
}

const char* SyncName(GradSync sync) {
  return sync == GradSync::kEager ? "eager" : "deferred";
}

// ---------------------------------------------------------------------------
// Rank side.

// k calls of kSamplesPerCall equal-length samples (so every data-parallel
// rank gets the same number of tokens), next-token targets.
std::vector<std::vector<Sample>> MakeCalls(int k) {
  std::vector<std::vector<Sample>> calls(k);
  for (int c = 0; c < k; ++c) {
    for (int s = 0; s < kSamplesPerCall; ++s) {
      std::vector<int32_t> text(kTokensPerSample + 1);
      for (int t = 0; t <= kTokensPerSample; ++t) {
        text[t] = (31 * s + 17 * t + 7 * c) % kByteVocab;
      }
      Sample sample;
      sample.input_tokens = std::vector<int32_t>(text.begin(), text.end() - 1);
      sample.target_tokens = std::vector<int32_t>(text.begin() + 1, text.end());
      calls[c].push_back(std::move(sample));
    }
  }
  return calls;
}

// The ZeRO stages a mesh runs: all three when it has dp_shard, else the
// default (the stage only changes what dp_shard does).
std::vector<ZeroStage> StagesOf(const MeshShape& shape) {
  if (shape.dp_shard == 1) return {ZeroStage::kParameters};
  return {ZeroStage::kParameters, ZeroStage::kGradients,
          ZeroStage::kOptimizerState};
}

// A cross-entropy ForwardBackward of `call` (token mean).
ForwardBackwardArgs CallArgs(std::vector<Sample> call) {
  ForwardBackwardArgs args;
  args.samples = std::move(call);
  return args;
}

ModelSpec BenchSpec(const std::string& id, GradSync sync) {
  ModelSpec spec;
  spec.model_id = id;
  spec.config = LlamaConfig::EmbeddedDefault();
  spec.seed = 1;
  spec.dtype = DType::kFloat32;
  spec.optimizer = OptimizerKind::kAdamW;
  spec.default_max_grad_norm = 1.0;
  spec.grad_sync = sync;
  return spec;
}

struct RoleGroup {
  const char* role;
  Communicator* comm;
};

// The engine's communicators by role, each once (a role may alias another).
std::vector<RoleGroup> DistinctGroups(const EngineGroups& g) {
  std::vector<RoleGroup> distinct;
  for (const RoleGroup& candidate :
       {RoleGroup{"world", g.world}, RoleGroup{"data", g.data},
        RoleGroup{"data_and_cp", g.data_and_cp},
        RoleGroup{"replicas", g.replicas},
        RoleGroup{"dp_replicate", g.dp_replicate},
        RoleGroup{"dp_shard", g.dp_shard}, RoleGroup{"cp", g.cp},
        RoleGroup{"tp", g.tp}, RoleGroup{"ep", g.ep},
        RoleGroup{"expert_replicas", g.expert_replicas}}) {
    bool seen = false;
    for (const RoleGroup& kept : distinct) seen |= kept.comm == candidate.comm;
    if (!seen) distinct.push_back(candidate);
  }
  return distinct;
}

struct StepTotals {
  int64_t micro_batches = 0;  // forward/backward passes of this rank
  int64_t padded_tokens = 0;  // their [batch x sequence] positions
  double seconds = 0.0;
};

// k ForwardBackward calls, then OptimStep.
absl::StatusOr<StepTotals> RunStep(
    Engine& engine, const std::string& id,
    const std::vector<std::vector<Sample>>& calls) {
  StepTotals totals;
  const auto start = std::chrono::steady_clock::now();
  for (const std::vector<Sample>& call : calls) {
    TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult fb,
                           engine.ForwardBackward(id, CallArgs(call)));
    totals.micro_batches +=
        static_cast<int64_t>(fb.metrics.at("micro_batches"));
    totals.padded_tokens +=
        static_cast<int64_t>(fb.metrics.at("padded_tokens"));
  }
  TALLY_ASSIGN_OR_RETURN(OptimStepResult step, engine.OptimStep(id, {}));
  if (step.skipped) {
    return absl::InternalError(
        absl::StrCat("the step of ", id, " was skipped: ", step.skip_reason));
  }
  totals.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return totals;
}

// Whether every rank passed the same `values`.
absl::StatusOr<bool> SameOnEveryRank(Communicator& world,
                                     const std::vector<int64_t>& values) {
  torch::Tensor mine = torch::tensor(values, torch::kInt64);
  TALLY_ASSIGN_OR_RETURN(torch::Tensor all, world.AllGather(mine));
  for (const torch::Tensor& theirs : all.chunk(world.size())) {
    if (!torch::equal(theirs, mine)) return false;
  }
  return true;
}

json MeshJson(const Engine& engine) {
  const MeshShape& shape = engine.mesh().shape();
  return {{"dp_replicate", shape.dp_replicate},
          {"dp_shard", shape.dp_shard},
          {"tp", shape.tp},
          {"zero_stage", static_cast<int>(engine.zero_stage())}};
}

// Psi_tp: the bytes of this rank's tp slice of the parameters (tp-replicated
// ones whole), before any dp_shard split.
int64_t TpLocalParamBytes(const CausalLm& model) {
  const int64_t element_bytes =
      static_cast<int64_t>(torch::elementSize(model.scalar_type()));
  int64_t bytes = 0;
  for (const Parameter& p : model.parameters()) {
    int64_t numel = 1;
    for (int64_t size : p.tp_local_shape) numel *= size;
    bytes += numel * element_bytes;
  }
  return bytes;
}

// One warm-up step (first-touch allocations stay out of the timing), then
// the measured step with every counter reset just before it.
absl::StatusOr<json> MeasureStep(Engine& engine, GradSync sync, int k) {
  const std::string id = absl::StrCat(SyncName(sync), "-k", k, "-zero",
                                      static_cast<int>(engine.zero_stage()));
  TALLY_RETURN_IF_ERROR(engine.CreateModel(BenchSpec(id, sync)).status());
  const std::vector<std::vector<Sample>> calls = MakeCalls(k);
  TALLY_RETURN_IF_ERROR(RunStep(engine, id, calls).status());
  const std::vector<RoleGroup> groups = DistinctGroups(engine.groups());
  for (const RoleGroup& g : groups) g.comm->stats().Reset();
  TALLY_ASSIGN_OR_RETURN(StepTotals step, RunStep(engine, id, calls));

  json group_rows = json::array();
  std::vector<int64_t> counters;
  for (const RoleGroup& g : groups) {
    json ops = json::object();
    for (int op = 0; op < kNumCommOps; ++op) {
      const CommCounter& c = g.comm->stats().Get(static_cast<CommOp>(op));
      ops[CommOpName(static_cast<CommOp>(op))] = {{"calls", c.calls},
                                                  {"bytes", c.bytes}};
      counters.push_back(c.calls);
      counters.push_back(c.bytes);
    }
    group_rows.push_back(
        {{"role", g.role}, {"size", g.comm->size()}, {"ops", ops}});
  }
  TALLY_ASSIGN_OR_RETURN(bool uniform,
                         SameOnEveryRank(engine.world(), counters));

  TALLY_ASSIGN_OR_RETURN(CausalLm * model, EngineTestPeer::Model(engine, id));
  const int64_t element_bytes =
      static_cast<int64_t>(torch::elementSize(model->scalar_type()));
  const int64_t tp_local_param_bytes = TpLocalParamBytes(*model);
  json row = {{"kind", "comm"},
              {"mesh", MeshJson(engine)},
              {"sync", SyncName(sync)},
              {"k", k},
              {"micro_batches", step.micro_batches},
              {"padded_tokens", step.padded_tokens},
              {"hidden_size", model->config().hidden_size},
              {"num_layers", model->config().num_hidden_layers},
              {"element_bytes", element_bytes},
              {"param_bytes",
               static_cast<int64_t>(model->NumParameters()) * element_bytes},
              {"tp_local_param_bytes", tp_local_param_bytes},
              {"step_seconds", step.seconds},
              {"uniform_across_ranks", uniform},
              {"groups", group_rows}};
  TALLY_RETURN_IF_ERROR(engine.DeleteModel(id).status());
  return row;
}

// Parameter, gradient and AdamW state bytes of this rank, as the engine
// reports them from an OptimStep (while the window's gradients exist).
absl::StatusOr<json> MeasureModelState(Engine& engine) {
  const std::string id =
      absl::StrCat("model-state-zero", static_cast<int>(engine.zero_stage()));
  TALLY_RETURN_IF_ERROR(
      engine.CreateModel(BenchSpec(id, GradSync::kEager)).status());
  TALLY_RETURN_IF_ERROR(
      engine.ForwardBackward(id, CallArgs(MakeCalls(1)[0])).status());
  TALLY_ASSIGN_OR_RETURN(OptimStepResult step, engine.OptimStep(id, {}));
  const auto params = static_cast<int64_t>(step.metrics["rank_param_bytes"]);
  const auto grads = static_cast<int64_t>(step.metrics["rank_grad_bytes"]);
  const auto optimizer =
      static_cast<int64_t>(step.metrics["rank_optimizer_bytes"]);
  TALLY_ASSIGN_OR_RETURN(
      bool uniform,
      SameOnEveryRank(engine.world(), {params, grads, optimizer}));
  TALLY_ASSIGN_OR_RETURN(CausalLm * model, EngineTestPeer::Model(engine, id));
  const int64_t psi = TpLocalParamBytes(*model);
  TALLY_RETURN_IF_ERROR(engine.DeleteModel(id).status());
  return json{{"kind", "model_state"},          {"mesh", MeshJson(engine)},
              {"param_bytes", params},          {"grad_bytes", grads},
              {"optimizer_bytes", optimizer},   {"tp_local_param_bytes", psi},
              {"uniform_across_ranks", uniform}};
}

std::optional<std::string> GetEnv(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::optional<std::string>(value) : std::nullopt;
}

absl::Status RunRank(const MeshShape& shape, const std::string& results_path) {
  SetLogLevel(LogLevel::kWarning);
  // One intra-op thread per rank: up to 8 ranks share the machine's cores.
  torch::set_num_threads(1);
  TALLY_ASSIGN_OR_RETURN(RankEnv env, ResolveRankEnv({}, GetEnv));
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroups> groups,
                         ProcessGroups::Create(env, mesh, kRendezvousTimeout));
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                         Engine::Create({}, mesh, std::move(groups)));
  std::vector<json> rows;
  for (ZeroStage stage : StagesOf(shape)) {
    EngineTestPeer::SetZeroStage(*engine, stage);
    for (GradSync sync : {GradSync::kEager, GradSync::kDeferred}) {
      for (int k : kCallsPerStep) {
        TALLY_ASSIGN_OR_RETURN(json row, MeasureStep(*engine, sync, k));
        rows.push_back(std::move(row));
      }
    }
    TALLY_ASSIGN_OR_RETURN(json state, MeasureModelState(*engine));
    rows.push_back(std::move(state));
  }
  if (env.rank != 0) return absl::OkStatus();
  std::ofstream out(results_path, std::ios::app);
  for (const json& row : rows) out << row.dump() << "\n";
  out.close();
  if (!out) {
    return absl::InternalError(absl::StrCat("cannot write ", results_path));
  }
  return absl::OkStatus();
}

LlamaConfig OverlapConfig() {
  LlamaConfig config = LlamaConfig::EmbeddedDefault();
  config.hidden_size = 256;
  config.intermediate_size = 704;
  config.num_hidden_layers = 6;
  return config;
}

// Times EAGER ForwardBackward calls on dp_replicate = 2, alternating the
// overlap off and on; rank 0 writes one row with every call's seconds.
absl::Status RunOverlapRank(const std::string& results_path) {
  SetLogLevel(LogLevel::kWarning);
  torch::set_num_threads(1);  // the two ranks share the machine's cores
  TALLY_ASSIGN_OR_RETURN(RankEnv env, ResolveRankEnv({}, GetEnv));
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(Shape(2, 1, 1), env.rank));
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroups> groups,
                         ProcessGroups::Create(env, mesh, kRendezvousTimeout));
  EngineOptions options;
  options.bucket_mb = kOverlapBucketMb;
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                         Engine::Create(options, mesh, std::move(groups)));
  ModelSpec spec = BenchSpec("overlap", GradSync::kEager);
  spec.config = OverlapConfig();
  TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
  std::vector<Sample> call = MakeCalls(1)[0];
  call.resize(kOverlapSamples);
  std::vector<double> seconds[2];  // [overlap]
  for (int pair = 0; pair < kOverlapWarmupPairs + kOverlapPairs; ++pair) {
    for (int i = 0; i < 2; ++i) {
      const bool overlap = (pair + i) % 2 == 1;
      EngineTestPeer::SetOverlapGradSync(*engine, overlap);
      const auto start = std::chrono::steady_clock::now();
      TALLY_RETURN_IF_ERROR(
          engine->ForwardBackward("overlap", CallArgs(call)).status());
      if (pair >= kOverlapWarmupPairs) {
        seconds[overlap].push_back(std::chrono::duration<double>(
                                       std::chrono::steady_clock::now() - start)
                                       .count());
      }
    }
  }
  TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                         EngineTestPeer::Model(*engine, "overlap"));
  if (env.rank != 0) return absl::OkStatus();
  std::ofstream out(results_path, std::ios::app);
  out << json{{"kind", "overlap"},
              {"params", model->NumParameters()},
              {"off_seconds", seconds[0]},
              {"on_seconds", seconds[1]}}
             .dump()
      << "\n";
  out.close();
  if (!out) {
    return absl::InternalError(absl::StrCat("cannot write ", results_path));
  }
  return absl::OkStatus();
}

absl::StatusOr<MeshShape> ParseMesh(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ',');
  int sizes[3];
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &sizes[0]) ||
      !absl::SimpleAtoi(parts[1], &sizes[1]) ||
      !absl::SimpleAtoi(parts[2], &sizes[2]) || sizes[0] < 1 || sizes[1] < 1 ||
      sizes[2] < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rank-of-mesh wants dp_replicate,dp_shard,tp, each >= 1; got ",
        text));
  }
  return Shape(sizes[0], sizes[1], sizes[2]);
}

// The command line: the launcher's (no rank flag) or a rank's.
struct Options {
  bool overlap_only = false;
  std::optional<MeshShape> rank_of_mesh;
  bool rank_of_overlap = false;
  std::string results;
};

// INVALID_ARGUMENT naming the flag when --results and the rank flags do not
// go together.
absl::Status CheckOptions(const Options& options) {
  const bool rank = options.rank_of_mesh || options.rank_of_overlap;
  if (rank && options.results.empty()) {
    return absl::InvalidArgumentError(
        "--results is required with --rank-of-mesh or --rank-of-overlap");
  }
  if (!rank && !options.results.empty()) {
    return absl::InvalidArgumentError(
        "--results is for a rank (--rank-of-mesh or --rank-of-overlap)");
  }
  return absl::OkStatus();
}

absl::StatusOr<Options> OptionsFromFlags() {
  Options options;
  options.overlap_only = absl::GetFlag(FLAGS_overlap_only);
  const std::string mesh = absl::GetFlag(FLAGS_rank_of_mesh);
  if (!mesh.empty()) {
    TALLY_ASSIGN_OR_RETURN(options.rank_of_mesh, ParseMesh(mesh));
  }
  options.rank_of_overlap = absl::GetFlag(FLAGS_rank_of_overlap);
  options.results = absl::GetFlag(FLAGS_results);
  TALLY_RETURN_IF_ERROR(CheckOptions(options));
  return options;
}

// ---------------------------------------------------------------------------
// Launcher side: wire bytes, theory and tables.

std::string MeshLabel(const json& mesh) {
  std::vector<std::string> dims;
  for (const char* dim : {"dp_replicate", "dp_shard", "tp"}) {
    const int size = mesh.at(dim).get<int>();
    if (size > 1) dims.push_back(absl::StrCat(dim, "=", size));
  }
  std::string label = dims.empty() ? "single rank" : absl::StrJoin(dims, " x ");
  // The stage only matters where dp_shard splits.
  if (mesh.at("dp_shard").get<int>() > 1) {
    absl::StrAppend(&label, " zero", mesh.at("zero_stage").get<int>());
  }
  return label;
}

int WorldSize(const json& mesh) {
  return mesh.at("dp_replicate").get<int>() * mesh.at("dp_shard").get<int>() *
         mesh.at("tp").get<int>();
}

// Per-rank bytes on the wire of a bandwidth-optimal (ring) algorithm, from
// the bytes a rank contributed (what the Communicator counts) in a group of
// n ranks: all-reduce of X sends 2X(n-1)/n; all-gather of a shard s sends
// s(n-1); reduce-scatter of a full input F sends F(n-1)/n natively, and
// 2F(n-1)/n on Gloo, where tally runs it as an all-reduce of F. Broadcast
// and send (none in a training step) count once.
struct Wire {
  double gloo = 0.0;
  double native_reduce_scatter = 0.0;
};

Wire WireBytes(const json& group) {
  const double n = group.at("size").get<int>();
  const json& ops = group.at("ops");
  auto bytes = [&](const char* op) {
    return ops.at(op).at("bytes").get<double>();
  };
  const double ring = (n - 1) / n;
  const double common = 2 * ring * bytes("all_reduce") +
                        (n - 1) * bytes("all_gather") + bytes("broadcast") +
                        bytes("send");
  return {common + 2 * ring * bytes("reduce_scatter"),
          common + ring * bytes("reduce_scatter")};
}

struct Volumes {
  int64_t collectives = 0;
  int64_t calls[3] = {0, 0, 0};  // all_reduce, all_gather, reduce_scatter
  int64_t counted[3] = {0, 0, 0};
  Wire dp;  // dp_replicate + dp_shard: gradients and ZeRO-3 parameters
  Wire tp;  // Megatron activations
  int64_t control_counted = 0;  // world + data: flags, token counts, norm
  double dp_theory = 0.0;
  double tp_theory = 0.0;
};

constexpr const char* kCountedOps[3] = {"all_reduce", "all_gather",
                                        "reduce_scatter"};

Volumes ComputeVolumes(const json& row) {
  Volumes v;
  for (const json& group : row.at("groups")) {
    const std::string role = group.at("role").get<std::string>();
    for (const auto& [op, counter] : group.at("ops").items()) {
      v.collectives += counter.at("calls").get<int64_t>();
    }
    for (int i = 0; i < 3; ++i) {
      const json& counter = group.at("ops").at(kCountedOps[i]);
      v.calls[i] += counter.at("calls").get<int64_t>();
      v.counted[i] += counter.at("bytes").get<int64_t>();
    }
    const Wire wire = WireBytes(group);
    if (role == "replicas" || role == "expert_replicas" ||
        role == "dp_replicate" || role == "dp_shard") {
      v.dp.gloo += wire.gloo;
      v.dp.native_reduce_scatter += wire.native_reduce_scatter;
    } else if (role == "tp") {
      v.tp = wire;
    } else {
      for (const auto& [op, counter] : group.at("ops").items()) {
        v.control_counted += counter.at("bytes").get<int64_t>();
      }
    }
  }

  const json& mesh = row.at("mesh");
  const double r = mesh.at("dp_replicate").get<int>();
  const double s = mesh.at("dp_shard").get<int>();
  const double t = mesh.at("tp").get<int>();
  // psi: the parameter bytes the data-parallel groups move, i.e. this rank's
  // tp slice (tp-replicated norms in full); the whole model when tp = 1.
  const double psi = row.at("tp_local_param_bytes").get<double>();
  const double passes = row.at("micro_batches").get<double>();
  const int zero = mesh.at("zero_stage").get<int>();
  const double k = row.at("k").get<double>();
  const bool eager = row.at("sync") == "eager";
  if (s > 1 && zero == 3) {
    // ZeRO-3, ring-style (seed-data-parallelism-zero): per forward/backward
    // pass, forward all-gather psi + backward all-gather psi + gradient
    // reduce-scatter psi, each (s-1)/s of it on the wire.
    v.dp_theory += 3 * psi * (s - 1) / s * passes;
  } else if (s > 1) {
    // ZeRO-1 and 2 (the seed's 2 psi per step): one reduce-scatter of the
    // gradients per sync and one all-gather of the updated parameters, each
    // psi (s-1)/s. A sync is every pass at stage 2 (gradients are sharded
    // as they are produced) and, at stage 1, every call under EAGER or once
    // per step under DEFERRED.
    const double syncs = zero == 2 ? passes : (eager ? k : 1.0);
    v.dp_theory += (syncs + 1) * psi * (s - 1) / s;
  }
  // DP all-reduce of this rank's gradient shard psi/s: 2 psi/s (r-1)/r per
  // synchronization; EAGER syncs after each of the k calls, DEFERRED once.
  if (r > 1) {
    const double syncs = eager ? k : 1.0;
    v.dp_theory += syncs * 2 * (psi / s) * (r - 1) / r;
  }
  // Megatron, per pass over P positions of hidden size h: 2 activation
  // all-reduces per layer forward and 2 backward, the vocab-parallel
  // embedding's forward and the lm_head input's backward ((4L + 2) P h
  // elements), plus the vocab-parallel cross-entropy's max and [sum-exp,
  // target] (3 P).
  if (t > 1) {
    const double positions = row.at("padded_tokens").get<double>();
    const double elements = (4 * row.at("num_layers").get<double>() + 2) *
                                positions *
                                row.at("hidden_size").get<double>() +
                            3 * positions;
    v.tp_theory =
        elements * row.at("element_bytes").get<double>() * 2 * (t - 1) / t;
  }
  return v;
}

std::string Megabytes(double bytes) {
  return absl::StrFormat("%.3f", bytes / 1e6);
}

std::string Ratio(double measured, double theory) {
  return theory > 0 ? absl::StrFormat("%.2f", measured / theory) : "-";
}

void PrintCommTables(const std::vector<json>& rows) {
  const json& first = rows.front();
  std::cout << absl::StrFormat(
      "Model: embedded default (%.3f MB of fp32 parameters = Psi), %d samples "
      "x %d tokens per ForwardBackward; one step = k ForwardBackward + "
      "OptimStep.\n\n",
      first.at("param_bytes").get<double>() / 1e6, kSamplesPerCall,
      kTokensPerSample);

  std::cout << "Table 1. Collectives and counted bytes per rank per step "
               "(counted = bytes this rank contributed: the input of an "
               "all-reduce or reduce-scatter, the shard of an all-gather; MB "
               "= 1e6 bytes)\n";
  std::cout << absl::StrFormat(
      "%-40s %-8s %2s %6s %11s | %9s %9s | %9s %9s | %9s %9s | %8s\n", "mesh",
      "sync", "k", "passes", "collectives", "AR calls", "AR MB", "AG calls",
      "AG MB", "RS calls", "RS MB", "step ms");
  for (const json& row : rows) {
    const Volumes v = ComputeVolumes(row);
    std::cout << absl::StrFormat(
        "%-40s %-8s %2d %6d %11d | %9d %9s | %9d %9s | %9d %9s | %8.1f%s\n",
        MeshLabel(row.at("mesh")), row.at("sync").get<std::string>(),
        row.at("k").get<int>(), row.at("micro_batches").get<int>(),
        v.collectives, v.calls[0], Megabytes(v.counted[0]), v.calls[1],
        Megabytes(v.counted[1]), v.calls[2], Megabytes(v.counted[2]),
        row.at("step_seconds").get<double>() * 1e3,
        row.at("uniform_across_ranks").get<bool>()
            ? ""
            : "  (ranks differ: rank 0 shown)");
  }

  std::cout
      << "\nTable 2. Wire bytes per rank per step (ring model: all-reduce "
         "2X(n-1)/n, all-gather s(n-1), reduce-scatter F(n-1)/n natively, "
         "2F(n-1)/n as Gloo's all-reduce + slice) against the theory\n"
         "  dp theory: ZeRO-3 3*Psi_tp*(S-1)/S per forward/backward pass; "
         "ZeRO-1/2 Psi_tp*(S-1)/S per gradient reduce-scatter (zero2: per "
         "pass; zero1: EAGER k, DEFERRED 1) + Psi_tp*(S-1)/S for the "
         "all-gather after the step; + DP all-reduce 2*(Psi_tp/S)*(R-1)/R per "
         "gradient sync (EAGER: k, DEFERRED: 1); Psi_tp = this rank's tp "
         "slice of Psi\n"
         "  tp theory: Megatron activation all-reduces ((4L+2)*P*h + 3P "
         "elements per pass over P positions) * 2(T-1)/T\n"
         "  control B: counted bytes on the world and data groups (failure "
         "flags, per-sample loss sums, the gradient norm's one all-reduce)\n";
  std::cout << absl::StrFormat(
      "%-40s %-8s %2s | %10s %10s %6s %10s %6s | %9s %9s %6s | %10s\n", "mesh",
      "sync", "k", "dp MB gloo", "dp theory", "ratio", "dp native", "ratio",
      "tp MB", "tp theory", "ratio", "control B");
  for (const json& row : rows) {
    const Volumes v = ComputeVolumes(row);
    std::cout << absl::StrFormat(
        "%-40s %-8s %2d | %10s %10s %6s %10s %6s | %9s %9s %6s | %10d\n",
        MeshLabel(row.at("mesh")), row.at("sync").get<std::string>(),
        row.at("k").get<int>(), Megabytes(v.dp.gloo), Megabytes(v.dp_theory),
        Ratio(v.dp.gloo, v.dp_theory), Megabytes(v.dp.native_reduce_scatter),
        Ratio(v.dp.native_reduce_scatter, v.dp_theory), Megabytes(v.tp.gloo),
        Megabytes(v.tp_theory), Ratio(v.tp.gloo, v.tp_theory),
        v.control_counted);
  }
}

// The seed's memory table (seed-data-parallelism-zero, section 9.1) for a
// row, in tally's fp32: parameters and gradients of Psi_tp bytes, AdamW's
// moments 2 Psi_tp, and at stages 1 and 2 the float32 master (the shard the
// optimizer steps, beside the gathered working copy) Psi_tp, the seed's k
// counting it with the moments. Stage 1 adds one term the seed leaves out:
// the reduced gradient shard Psi_tp/S beside the whole gradient.
double SeedModelStateBytes(const json& row) {
  const json& mesh = row.at("mesh");
  const double psi = row.at("tp_local_param_bytes").get<double>();
  const double s = mesh.at("dp_shard").get<int>();
  switch (s > 1 ? mesh.at("zero_stage").get<int>() : 3) {
    case 1:
      return psi + psi + 3 * psi / s + psi / s;
    case 2:
      return psi + (psi + 3 * psi) / s;
    default:
      return (psi + psi + 2 * psi) / s;
  }
}

double ModelStateTotal(const json& row) {
  return row.at("param_bytes").get<double>() +
         row.at("grad_bytes").get<double>() +
         row.at("optimizer_bytes").get<double>();
}

// Prints the model-state table; false when a row does not equal the seed's
// table or the stage-3 dp_shard-only meshes do not scale as 1/S.
bool PrintModelStateTable(const std::vector<json>& rows) {
  std::optional<double> unsharded;
  for (const json& row : rows) {
    if (WorldSize(row.at("mesh")) == 1) unsharded = ModelStateTotal(row);
  }
  std::cout << "\nTable 3. Model state per rank (fp32 parameters, gradients "
               "after one ForwardBackward, AdamW moments) against the seed's "
               "memory table: zero3 (P+G+2P)/S; zero2 P + (G+2P+P)/S; zero1 "
               "P + G + (2P+P)/S + G/S, with P = G = Psi_tp (the +P in "
               "zero1/2: the float32 master shard beside the gathered copy; "
               "the +G/S in zero1: the reduced shard beside the whole "
               "gradient)\n";
  std::cout << absl::StrFormat("%-40s %10s %10s %12s %10s %10s %6s %16s\n",
                               "mesh", "params MB", "grads MB", "optimizer MB",
                               "total MB", "seed MB", "ratio",
                               "total*S/total(1)");
  bool scales = unsharded.has_value();
  bool follows_seed = true;
  for (const json& row : rows) {
    const json& mesh = row.at("mesh");
    const double total = ModelStateTotal(row);
    const double seed = SeedModelStateBytes(row);
    const double ratio = total / seed;
    std::string ratio_text = absl::StrFormat("%.4f", ratio);
    if (std::abs(ratio - 1.0) > kSeedTolerance) {
      ratio_text += " NOT SEED";
      follows_seed = false;
    }
    const int s = mesh.at("dp_shard").get<int>();
    const bool shard_only =
        WorldSize(mesh) == s && s > 1 && mesh.at("zero_stage").get<int>() == 3;
    std::string scaling = "-";
    if (shard_only && unsharded) {
      const double scaled = total * s / *unsharded;
      scaling = absl::StrFormat("%.4f", scaled);
      if (scaled < 1.0 || scaled > 1.0 + kShardingTolerance) {
        scaling += "  NOT 1/S";
        scales = false;
      }
    }
    std::cout << absl::StrFormat(
        "%-40s %10s %10s %12s %10s %10s %6s %16s%s\n", MeshLabel(mesh),
        Megabytes(row.at("param_bytes").get<double>()),
        Megabytes(row.at("grad_bytes").get<double>()),
        Megabytes(row.at("optimizer_bytes").get<double>()), Megabytes(total),
        Megabytes(seed), ratio_text, scaling,
        row.at("uniform_across_ranks").get<bool>()
            ? ""
            : "  (ranks differ: rank 0 shown)");
  }
  std::cout << (scales ? "zero3 dp_shard meshes scale as 1/S: yes\n"
                       : "zero3 dp_shard meshes scale as 1/S: NO\n");
  std::cout << (follows_seed ? "every row equals the seed's table: yes\n"
                             : "every row equals the seed's table: NO\n");
  return scales && follows_seed;
}

// Whether every ZeRO-1/2 row moves exactly the theory's bytes over the
// data-parallel groups with a native reduce-scatter (Gloo's costs 1.5x:
// its reduce-scatter is an all-reduce).
bool ZeroRowsEqualTheTheory(const std::vector<json>& rows) {
  bool equal = true;
  for (const json& row : rows) {
    const json& mesh = row.at("mesh");
    if (mesh.at("dp_shard").get<int>() == 1 ||
        mesh.at("zero_stage").get<int>() == 3) {
      continue;
    }
    const Volumes v = ComputeVolumes(row);
    equal &= std::abs(v.dp.native_reduce_scatter / v.dp_theory - 1.0) <=
             kSeedTolerance;
  }
  std::cout << (equal ? "zero1/zero2 rows equal the theory (native "
                        "reduce-scatter): yes\n"
                      : "zero1/zero2 rows equal the theory (native "
                        "reduce-scatter): NO\n");
  return equal;
}

json SummaryJson(const json& row) {
  const Volumes v = ComputeVolumes(row);
  json out = {{"bench", "comm"},
              {"mesh", row.at("mesh")},
              {"sync", row.at("sync")},
              {"k", row.at("k")},
              {"passes", row.at("micro_batches")},
              {"collectives", v.collectives},
              {"param_bytes", row.at("param_bytes")},
              {"dp_wire_bytes_gloo", std::llround(v.dp.gloo)},
              {"dp_wire_bytes_native_reduce_scatter",
               std::llround(v.dp.native_reduce_scatter)},
              {"dp_theory_bytes", std::llround(v.dp_theory)},
              {"tp_wire_bytes", std::llround(v.tp.gloo)},
              {"tp_theory_bytes", std::llround(v.tp_theory)},
              {"control_counted_bytes", v.control_counted},
              {"step_seconds", row.at("step_seconds")},
              {"uniform_across_ranks", row.at("uniform_across_ranks")}};
  for (int i = 0; i < 3; ++i) {
    out["counted"][kCountedOps[i]] = {{"calls", v.calls[i]},
                                      {"bytes", v.counted[i]}};
  }
  return out;
}

// Runs `nproc` copies of this binary with `rank_flag` and the results file;
// returns the rows rank 0 wrote.
absl::StatusOr<std::vector<json>> LaunchRanks(const std::string& self,
                                              int nproc,
                                              const std::string& rank_flag,
                                              const std::string& label) {
  std::string path = "/tmp/bench_comm_XXXXXX";
  const int fd = mkstemp(path.data());
  if (fd < 0) return absl::InternalError("mkstemp failed for the results file");
  close(fd);
  LaunchOptions launch;
  launch.nproc = nproc;
  launch.args = {self, rank_flag, absl::StrCat(kResultsFlag, path)};
  const absl::Status launched = LaunchAndSupervise(launch);
  std::vector<json> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    rows.push_back(json::parse(line, nullptr, /*allow_exceptions=*/false));
    if (rows.back().is_discarded()) {
      return absl::InternalError(absl::StrCat("bad result line: ", line));
    }
  }
  std::remove(path.c_str());
  if (!launched.ok()) {
    return absl::Status(launched.code(),
                        absl::StrCat(label, ": ", launched.message()));
  }
  return rows;
}

absl::StatusOr<std::vector<json>> LaunchMesh(const std::string& self,
                                             const MeshShape& shape) {
  return LaunchRanks(self, shape.world_size(),
                     absl::StrCat(kMeshFlag, shape.dp_replicate, ",",
                                  shape.dp_shard, ",", shape.tp),
                     absl::StrCat("mesh ", shape.ToString()));
}

void BlockLauncherSignals() {
  // The launcher waits for these with sigtimedwait; block them before any
  // thread starts (see server/launcher.h).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
}

int RunOverlapSection(const std::string& self) {
  absl::StatusOr<std::vector<json>> rows =
      LaunchRanks(self, 2, kOverlapFlag, "overlap section");
  if (!rows.ok() || rows->size() != 1) {
    std::cerr << "bench_comm: "
              << (rows.ok() ? absl::InternalError("expected one overlap row")
                            : rows.status())
              << "\n";
    return 1;
  }
  const json& row = rows->front();
  const int64_t params = row.at("params").get<int64_t>();
  const std::vector<double> off = row.at("off_seconds");
  const std::vector<double> on = row.at("on_seconds");
  const double after = torch::tensor(off).median().item<double>();
  const double during = torch::tensor(on).median().item<double>();
  std::cout << absl::StrFormat(
      "\nGradient sync overlap: EAGER ForwardBackward, dp_replicate=2, %d "
      "params (fp32), %d MiB buckets, %d x %d tokens per call; %d calls per "
      "mode alternating in one run; medians\n",
      params, kOverlapBucketMb, kOverlapSamples, kTokensPerSample,
      kOverlapPairs);
  std::cout << absl::StrFormat("  %-38s %10s\n", "buckets summed", "s / call");
  std::cout << absl::StrFormat("  %-38s %10.4f\n", "after backward (off)",
                               after);
  std::cout << absl::StrFormat("  %-38s %10.4f\n",
                               "during backward (--overlap-grad-sync)", during);
  std::cout << absl::StrFormat("  off / on = %.3f\n", after / during);
  std::cout << json{{"bench", "grad_sync_overlap"},
                    {"params", params},
                    {"bucket_mb", kOverlapBucketMb},
                    {"calls_per_mode", kOverlapPairs},
                    {"after_s", after},
                    {"during_s", during},
                    {"off_over_on", after / during}}
                   .dump()
            << "\n";
  return 0;
}

int RunBenchmark(const std::string& self, bool overlap_only) {
  BlockLauncherSignals();
  // The launcher's per-rank start and exit lines would bury the tables.
  SetLogLevel(LogLevel::kWarning);
  if (overlap_only) return RunOverlapSection(self);
  std::vector<json> comm_rows, state_rows;
  for (const MeshShape& shape : BenchMeshes()) {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<json>> rows = LaunchMesh(self, shape);
    if (!rows.ok()) {
      std::cerr << "bench_comm: " << rows.status() << "\n";
      return 1;
    }
    std::cerr << absl::StrFormat("bench_comm: %s (%d ranks) done in %.1f s\n",
                                 shape.ToString(), shape.world_size(),
                                 absl::ToDoubleSeconds(absl::Now() - start));
    for (json& row : *rows) {
      (row.at("kind") == "comm" ? comm_rows : state_rows)
          .push_back(std::move(row));
    }
  }
  PrintCommTables(comm_rows);
  const bool zero_equal = ZeroRowsEqualTheTheory(comm_rows);
  const bool checks_hold = PrintModelStateTable(state_rows) && zero_equal;
  std::cout << "\nJSON (one line per row):\n";
  for (const json& row : comm_rows)
    std::cout << SummaryJson(row).dump() << "\n";
  for (json row : state_rows) {
    row.erase("kind");
    row["bench"] = "model_state";
    std::cout << row.dump() << "\n";
  }
  const int overlap = RunOverlapSection(self);
  return checks_hold ? overlap : 1;
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
  const absl::StatusOr<tally::Options> options = tally::ParseBenchOptions(
      tally::kUsage, argc, argv, tally::OptionsFromFlags);
  if (!options.ok()) {
    std::cerr << "bench_comm: " << options.status() << "\n";
    return tally::kBadFlagExitStatus;
  }
  if (!options->rank_of_mesh && !options->rank_of_overlap) {
    return tally::RunBenchmark(argv[0], options->overlap_only);
  }

  alarm(tally::kRankDeadlineSeconds);
  const absl::Status status =
      options->rank_of_mesh
          ? tally::RunRank(*options->rank_of_mesh, options->results)
          : tally::RunOverlapRank(options->results);
  if (!status.ok()) {
    std::cerr << "bench_comm rank: " << status << "\n";
    return 1;
  }
  return 0;
}
