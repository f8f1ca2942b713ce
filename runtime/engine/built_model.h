// BuiltModel: one model of one rank as CreateModel builds it, with all that
// follows from how it was built. BuildModel runs the steps of a build once,
// in order:
//   1. family: the config, from the spec or its init_checkpoint (whose
//      config.json names the family), defaults and validation;
//   2. converters: a LoRA adapter (runtime/model/lora.h) gets its factors as
//      parameters of their own over a frozen base, shared through
//      SharedBases;
//   3. parallelize: this rank's shards and pipeline stage of every
//      parameter (its ShardingPlan over the groups, the ZeRO stage), the
//      init weights loaded into them, frozen patterns, activation
//      checkpointing, attention, and the device.
// The BuiltModel it returns owns the model, its optimizer, the
// GradientSync chosen for it and its consolidation for save and export;
// it takes this rank's groups and phases explicitly (RankContext). The
// engine keeps the window and the model's state (step, poison, damage) and
// asks the BuiltModel for everything that depends on what the model is.
//
//   tally::RankContext rank{mesh, groups, phases};
//   absl::StatusOr<std::unique_ptr<tally::BuiltModel>> built =
//       tally::BuildModel(spec, base_key, rank, options, bases);
//   TALLY_RETURN_IF_ERROR(phases.Agree(built.status()));  // all ranks built
//   TALLY_RETURN_IF_ERROR((*built)->FinishBuild());
//   ... ForwardBackward calls on (*built)->model() ...
//   TALLY_RETURN_IF_ERROR((*built)->gradient_sync().SumAccumulated());
//   TALLY_RETURN_IF_ERROR((*built)->Step(adam, grad_scale));
#ifndef TALLY_RUNTIME_ENGINE_BUILT_MODEL_H_
#define TALLY_RUNTIME_ENGINE_BUILT_MODEL_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/weights_export.h"
#include "runtime/config/types.h"
#include "runtime/engine/consolidation.h"
#include "runtime/model/causal_lm.h"
#include "runtime/model/shared_bases.h"
#include "runtime/parallel/engine_groups.h"
#include "runtime/parallel/mesh.h"
#include "runtime/parallel/rank_phases.h"
#include "runtime/train/gradient_sync.h"
#include "runtime/train/optimizer.h"

namespace tally {

// This rank's place in the deployment: what a built model runs its
// collectives over. `mesh` and `groups` outlive every model built with them.
struct RankContext {
  const Mesh& mesh;
  const EngineGroups& groups;
  RankPhases phases;
};

// How every model of an engine is built (from EngineOptions).
struct BuildOptions {
  // Where the parameters, gradients and optimizer state live.
  torch::Device device = torch::kCPU;
  AttentionOptions attention;
  // What dp_shard shards (runtime/parallel/zero.h).
  ZeroStage zero_stage = ZeroStage::kParameters;
  // The size of a flat bucket of the gradient sums over the replicas.
  int64_t bucket_bytes = int64_t{25} << 20;
};

// A checkpoint read and checked against a model (LoadCheckpoint's first
// phase), not applied yet.
struct StagedLoad {
  // Its weights and optimizer state as this rank's shards.
  CheckpointContents contents;
  // The optimizer the model gets once the weights are in: the checkpoint's
  // state, or zero moments.
  std::unique_ptr<Optimizer> optimizer;
};

// The bytes of training state this rank holds for a model.
struct RankStateBytes {
  // The shards, a bfloat16 model's bfloat16 copies of its weights
  // (CausalLm::ComputeWeightBytes), and under ZeRO-1/2 the gathered copies
  // (and ZeRO-1's whole gradients) besides.
  double parameters = 0;
  double gradients = 0;
  double optimizer = 0;
};

class BuiltModel {
 public:
  // `model` built from `spec` (resolved: its config and adapter settled) on
  // this rank; gets a fresh optimizer and its GradientSync.
  BuiltModel(ModelSpec spec, std::string base_key,
             std::unique_ptr<CausalLm> model, const RankContext& rank,
             int64_t bucket_bytes);

  const ModelSpec& spec() const { return spec_; }
  // CurrentBaseKey(spec) at creation: what identifies the model's shared
  // base (empty: none).
  const std::string& base_key() const { return base_key_; }
  CausalLm& model() { return *model_; }
  const CausalLm& model() const { return *model_; }
  Optimizer& optimizer() { return *optimizer_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  GradientSync& gradient_sync() { return gradient_sync_; }
  const RankContext& rank() const { return rank_; }

  // The collective part of a build, once every rank built its copy:
  // ZeRO-1/2 gather the copies they keep (nothing otherwise). On failure
  // the model must be dropped.
  absl::Status FinishBuild();
  // What a ModelSummary says of the model itself; the caller adds its step,
  // window and damage.
  ModelSummary Describe() const;
  RankStateBytes StateBytes() const;
  // Zeroes every gradient (the window's).
  void ClearGradients();

  // The optimizer update with `hp`, every gradient scaled by `grad_scale`,
  // agreed by the ranks, then the kept gathered copies refreshed. A failure
  // may leave the parameters partly updated.
  absl::Status Step(const AdamParams& hp, double grad_scale);

  // LoadCheckpoint's first phase, which changes nothing: reads `path`,
  // checks it against the model (an adapter loads only an adapter's
  // checkpoint), keeps this rank's shards and stages the optimizer (its
  // state with `load_optimizer`). Fails on this rank only: the ranks agree
  // before any of them applies it.
  absl::StatusOr<StagedLoad> StageLoad(const std::string& path,
                                       bool load_optimizer);
  // The second phase: copies the weights in, refreshes the gathered copies
  // and takes `staged`'s optimizer. A failure may leave the weights mixed.
  absl::Status ApplyLoad(StagedLoad& staged);

  // Writes a checkpoint to `path` through rank 0 (every rank calls it):
  // `manifest` with its step and unsaved window set; the rest comes from
  // the spec. An adapter's checkpoint holds the adapter only. Returns the
  // bytes written (0 on the other ranks).
  absl::StatusOr<uint64_t> SaveCheckpoint(const std::string& path,
                                          CheckpointManifest manifest,
                                          const SaveOptions& options);
  // Writes the weights as an HF model directory through rank 0 (every rank
  // calls it; the others return an empty result); an adapter unmerged
  // writes the adapter only.
  absl::StatusOr<ExportResult> ExportWeights(const std::string& path,
                                             const ExportOptions& options);

 private:
  // What changed in the shards, for RefreshGathered.
  enum class ShardsChanged {
    kCreated,  // a new model: every copy never gathered (not a shared base's)
    kLoaded,   // every parameter but a shared base's
    kStepped,  // the trainable parameters
  };
  // ZeRO-1/2 (nothing at stage 3): re-gathers the kept copies of what
  // changed, and the ranks agree on the outcome. A failure leaves stale
  // copies.
  absl::Status RefreshGathered(ShardsChanged changed);
  Consolidation consolidation() const;

  ModelSpec spec_;
  std::string base_key_;
  std::unique_ptr<CausalLm> model_;
  std::unique_ptr<Optimizer> optimizer_;
  RankContext rank_;
  GradientSync gradient_sync_;
};

// Runs the steps of a build (see above) for `spec` on this rank. `base_key`
// is CurrentBaseKey(spec), agreed by the ranks; an adapter shares the base
// `bases` holds under it, or builds one. INVALID_ARGUMENT for a config that
// differs from init_checkpoint's, an adapter's checkpoint as
// init_checkpoint, a bad adapter or a combination not implemented; ABORTED
// when a new base's directory no longer holds what `base_key` names once
// read. Collective-free: it can fail on one rank only.
absl::StatusOr<std::unique_ptr<BuiltModel>> BuildModel(
    ModelSpec spec, const std::string& base_key, const RankContext& rank,
    const BuildOptions& options, const SharedBases& bases);

}  // namespace tally

#endif  // TALLY_RUNTIME_ENGINE_BUILT_MODEL_H_
