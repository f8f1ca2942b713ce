// Engine: tally's training core. Keeps the models of one rank by id — each
// a BuiltModel (runtime/engine/built_model.h: the model, its optimizer, its
// gradient sync and consolidation, all decided when it was built) with its
// accumulation window, step and the state machine of a window that may be
// poisoned and of parameters that may be damaged — and executes the
// training commands on them.
//
// The engine is what a rank runs; the gRPC server is a front end that
// validates requests and feeds commands to it. A single-rank engine is the
// multi-rank engine with every mesh dimension of size 1: the same code path,
// including the collectives. Not thread-safe: callers run one command at a
// time (the server's executor does).
//
//   TALLY_ASSIGN_OR_RETURN(auto engine, tally::Engine::CreateSingleRank({}));
//   TALLY_ASSIGN_OR_RETURN(tally::ModelSummary m, engine->CreateModel(spec));
//   TALLY_ASSIGN_OR_RETURN(auto fb, engine->ForwardBackward(m.model_id, args));
//   TALLY_ASSIGN_OR_RETURN(auto step, engine->OptimStep(m.model_id, {}));
#ifndef TALLY_RUNTIME_ENGINE_ENGINE_H_
#define TALLY_RUNTIME_ENGINE_ENGINE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/weights_export.h"
#include "runtime/config/types.h"
#include "runtime/engine/built_model.h"
#include "runtime/engine/sample_call.h"
#include "runtime/engine/sampler_snapshots.h"
#include "runtime/model/causal_lm.h"
#include "runtime/model/shared_bases.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/engine_groups.h"
#include "runtime/parallel/mesh.h"
#include "runtime/parallel/rank_phases.h"
#include "runtime/train/accumulation.h"
#include "runtime/train/optimizer.h"
#include "runtime/train/token_loss.h"

namespace tally {

struct EngineOptions {
  // Where every model's parameters, gradients, window and optimizer state
  // live and compute (runtime/parallel/device.h picks it per rank); decided
  // once.
  torch::Device device = torch::kCPU;
  // TF32 tensor-core matmuls for float32 models on CUDA: faster, no longer
  // exact to float32 rounding. Off by default.
  bool allow_tf32 = false;
  // Padded tokens per forward/backward micro-batch; bounds activation memory
  // for large calls without changing results (the losses are raw sums).
  int64_t max_batch_tokens = 16384;
  // MiB per flat bucket of the gradient all-reduce over the replicas
  // (dp_replicate x cp; one collective per bucket); every rank needs the
  // same value.
  int64_t bucket_mb = 25;
  // Under pipeline parallelism: how many parts each data rank's samples of
  // a call are split into (each then batched by max_batch_tokens) to flow
  // through the stages; 0 means the number of stages.
  int pp_microbatches = 0;
  // EAGER: start the buckets' all-reduces from gradient hooks during the
  // last backward of a call, so communication overlaps the rest of it (same
  // results, bitwise). Off: all of them after backward.
  bool overlap_grad_sync = true;
  // How every model computes attention (CausalLm::set_attention).
  AttentionOptions attention;
  // What dp_shard shards (runtime/parallel/zero.h): stage 3 (FSDP) gathers the
  // parameters for every pass; stages 1 and 2 keep them gathered between
  // steps. Checkpoints do not depend on it; every rank needs the same value.
  ZeroStage zero_stage = ZeroStage::kParameters;
};

// A failed ForwardBackward or OptimStep that poisoned its model's window
// says so in its status (a payload the gRPC status does not carry), so a
// caller counts poisoned windows from the results it already has.
bool PoisonedTheWindow(const absl::Status& status);

class Engine {
 public:
  // A rank of a multi-rank deployment; `groups` must span `mesh`.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      const EngineOptions& options, Mesh mesh,
      std::unique_ptr<ProcessGroups> groups);
  // The whole deployment in this process: every mesh dimension of size 1,
  // over a real one-rank c10d group.
  static absl::StatusOr<std::unique_ptr<Engine>> CreateSingleRank(
      const EngineOptions& options);
  ~Engine();

  // ALREADY_EXISTS for a taken id; an empty id gets "model-<n>", and a scope
  // alone ("<tenant>/") gets "<tenant>/model-<n>".
  absl::StatusOr<ModelSummary> CreateModel(const ModelSpec& spec);
  absl::StatusOr<ModelSummary> GetModel(const std::string& model_id) const;
  std::vector<ModelSummary> ListModels() const;
  absl::StatusOr<ModelSummary> DeleteModel(const std::string& model_id);

  absl::StatusOr<ForwardBackwardResult> ForwardBackward(
      const std::string& model_id, const ForwardBackwardArgs& args);
  absl::StatusOr<OptimStepResult> OptimStep(const std::string& model_id,
                                            const OptimStepArgs& args);
  // Returns what was discarded.
  absl::StatusOr<WindowCounts> AbortAccumulation(const std::string& model_id);
  // Marks the model's window poisoned, like a ForwardBackward that failed
  // midway: the next OptimStep is ABORTED, quoting `reason`, until
  // AbortAccumulation. The server does it when a sequenced request of the
  // window never arrived. Returns whether this call poisoned it (false when
  // it already was).
  absl::StatusOr<bool> PoisonWindow(const std::string& model_id,
                                    const std::string& reason);
  absl::StatusOr<bool> WindowPoisoned(const std::string& model_id) const;

  // FAILED_PRECONDITION while a window is pending (or poisoned) unless
  // options.allow_pending. ForwardBackward, OptimStep and SaveCheckpoint
  // refuse a model whose parameters a failed OptimStep or LoadCheckpoint may
  // have left partly updated (ModelSummary::damage), until a LoadCheckpoint.
  absl::StatusOr<SaveResult> SaveCheckpoint(const std::string& model_id,
                                            const std::string& path,
                                            const SaveOptions& options = {});
  // Clears the pending window. load_optimizer = false: weights only, the
  // optimizer restarts from zero moments.
  absl::StatusOr<LoadResult> LoadCheckpoint(const std::string& model_id,
                                            const std::string& path,
                                            bool load_optimizer);

  // Writes the model's weights as an HF model directory for inference
  // (WriteWeightsExport, weights_export.h), with the generation config,
  // tokenizer files and extra config.json fields of its init_checkpoint.
  // Weights only: a pending (or poisoned) window neither blocks it nor
  // changes. FAILED_PRECONDITION for a damaged model, as SaveCheckpoint.
  // Every rank takes part; rank 0 writes and returns the result (the other
  // ranks an empty one once it succeeded).
  absl::StatusOr<ExportResult> ExportWeights(const std::string& model_id,
                                             const std::string& path,
                                             const ExportOptions& options = {});

  // Completes args.prompts (sample_call.h) with the model's weights after
  // its last OptimStep: a pending (or poisoned) window is neither visible
  // nor changed. FAILED_PRECONDITION for a damaged model, as
  // SaveCheckpoint. Every rank takes part and returns the whole result; a
  // call without a seed samples with one rank 0 draws. A non-empty
  // `sampler` reads that sampler snapshot of the model instead (NOT_FOUND
  // naming it when absent), result.step the snapshot's; the live weights
  // are back when the call returns.
  absl::StatusOr<SampleCallResult> Sample(const std::string& model_id,
                                          SampleArgs args,
                                          const std::string& sampler = "");
  // Each prompt's log-probabilities from the same weights, as Sample.
  absl::StatusOr<LogprobsCallResult> ComputeLogprobs(
      const std::string& model_id, const LogprobsArgs& args,
      const std::string& sampler = "");

  // Sampler snapshots (sampler_snapshots.h), in engine_sampler.cc. Freezes
  // the model's weights after its last OptimStep (never a pending window's:
  // the window holds gradients, not weights) as `name`, on every rank its
  // own shard; a LoRA model's adapter alone. INVALID_ARGUMENT for a bad
  // name, ALREADY_EXISTS for a taken one, FAILED_PRECONDITION for a damaged
  // model; the ranks agree, so a copy that fails on one rank keeps none.
  // Later OptimSteps and LoadCheckpoints do not change it; DeleteModel
  // deletes it.
  absl::StatusOr<SamplerSummary> SaveWeightsForSampler(
      const std::string& model_id, const std::string& name);
  // The snapshots of `model_id` (empty: of every model), by model id then
  // name; NOT_FOUND for an unknown model.
  absl::StatusOr<std::vector<SamplerSummary>> ListSamplers(
      const std::string& model_id) const;
  // NOT_FOUND naming the sampler (or the model) when absent.
  absl::StatusOr<SamplerSummary> DeleteSampler(const std::string& model_id,
                                               const std::string& name);

  // A model's parameters, to read (the server's memory gauges). Tests and
  // benchmarks reach further through EngineTestPeer
  // (tests/testing/engine_test_peer.h).
  absl::StatusOr<const CausalLm*> model(const std::string& model_id) const;
  // EngineOptions::zero_stage of the models created from now on.
  ZeroStage zero_stage() const { return options_.zero_stage; }
  const Mesh& mesh() const { return mesh_; }
  // Where this engine's models live (EngineOptions::device).
  const torch::Device& device() const { return options_.device; }
  Communicator& world() { return *groups_.world; }
  // Reserved for replicating commands from rank 0 (never used by training
  // math, so a command broadcast cannot interleave with a collective).
  Communicator& control() { return *control_; }
  const EngineGroups& groups() const { return groups_; }
  // The first failure of a collective on this rank's groups, OK while there
  // was none. A failed or timed-out collective leaves the groups unusable
  // (peers may be anywhere in the operation): the process must restart,
  // unless the failure was a rank's that failed between collectives
  // (ProcessGroups::FailFast): the phase of the command that saw it
  // re-forms the groups before the command returns (FinishPhase,
  // runtime/parallel/phase_boundary.h), and this is OK again.
  absl::Status CollectiveFailure() const;
  size_t num_models() const { return models_.size(); }
  // Whether a shared base of `base_key` (BaseKey) is in memory: some model
  // shares it.
  bool HasBase(const std::string& base_key) const {
    return bases_.Find(base_key) != nullptr;
  }
  // The config of that base while it is in memory: what a model created
  // with `base_key` (CurrentBaseKey) is built on.
  std::optional<LlamaConfig> BaseConfig(const std::string& base_key) const {
    return bases_.Config(base_key);
  }

 private:
  friend class EngineTestPeer;

  struct ModelState {
    std::unique_ptr<BuiltModel> built;
    AccumulationWindow window;
    int64_t step = 0;
    // Set when a ForwardBackward failed after it may have added gradients
    // (or a request of the window went missing): the window can no longer be
    // trusted until it is aborted. `poison_reason` says why.
    bool poisoned = false;
    std::string poison_reason;
    // Set when the parameters may be partly updated (an optimizer step or a
    // weight copy failed midway): the model refuses to train or be saved
    // until a LoadCheckpoint replaces them. Says why.
    std::string damage;
    // DEFERRED: the window's gradients were already summed over the replicas
    // and tied copies (by an OptimStep that then refused to step), so later
    // calls of the window must sum their own share before adding it.
    bool replicas_summed = false;
    // The init_checkpoint's EOS tokens: a Sample's default stop.
    std::vector<int64_t> eos_token_ids;
    // Its sampler snapshots, which go with it.
    SamplerSnapshots samplers;

    const ModelSpec& spec() const { return built->spec(); }
  };

  Engine(const EngineOptions& options, Mesh mesh)
      : options_(options), mesh_(std::move(mesh)) {}

  absl::StatusOr<ModelState*> Find(const std::string& model_id);
  absl::StatusOr<const ModelState*> Find(const std::string& model_id) const;
  static ModelSummary Summarize(const ModelState& state);
  // How this rank ends the phases of a command: over process_groups_, or
  // over single_rank_world_.
  RankPhases phases() const;
  // What OptimStep steps with, resolved and checked (with the window and
  // the model's state) before anything is summed or measured.
  struct StepSettings {
    AdamParams hp;
    double max_norm = 0;
    double normalizer = 0;
  };
  static absl::StatusOr<StepSettings> CheckStep(const ModelState& state,
                                                const OptimStepArgs& args);
  // DEFERRED: sums the window once (a no-op when done or EAGER); a failure
  // poisons the window.
  absl::Status SumWindow(ModelState& state);
  static void ClearWindow(ModelState& state);
  // FAILED_PRECONDITION naming the damage when the parameters may be partly
  // updated.
  static absl::Status CheckIntact(const ModelState& state);
  // Whether this poisoned the window (false when it already was).
  static bool Poison(ModelState& state, std::string reason);
  // The weights a Sample or ComputeLogprobs of `state` reads, and their
  // step: the live ones (intact, CheckIntact; null) or `sampler`'s, swapped
  // in for as long as the result lives.
  static absl::StatusOr<std::unique_ptr<SwappedInWeights>> WeightsToSample(
      ModelState& state, const std::string& sampler, int64_t* step);

  EngineOptions options_;
  Mesh mesh_;
  // Owners of the communicators in groups_: one of the two is set.
  std::unique_ptr<ProcessGroups> process_groups_;
  std::unique_ptr<Communicator> single_rank_world_;
  EngineGroups groups_;
  Communicator* control_ = nullptr;
  std::map<std::string, std::unique_ptr<ModelState>> models_;
  // The bases the models share.
  SharedBases bases_;
  int64_t next_auto_id_ = 1;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_ENGINE_ENGINE_H_
