#include "runtime/engine/built_model.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/checkpoint/directory_identity.h"
#include "runtime/checkpoint/lora_adapter_reader.h"
#include "runtime/model/freeze_parameters.h"
#include "runtime/model/lora.h"
#include "runtime/parallel/fault_hook.h"
#include "runtime/parallel/zero.h"
#include "runtime/train/accumulation.h"

namespace tally {
namespace {

// Renames the HF weights of `contents` to the model's parameters, replaces
// the full tensors by this rank's shards of them and, under pp, drops those
// of other stages' parameters. Tensors that match no parameter of the model
// (or not its full shape) are left for LoadWeightsInto / LoadState to
// report.
absl::Status KeepLocalShards(const CausalLm& model, bool staged,
                             CheckpointContents& contents) {
  TALLY_ASSIGN_OR_RETURN(contents.weights,
                         model.FromHfTensors(std::move(contents.weights)));
  // Returns false for a tensor of another stage.
  auto localize = [&](const std::string& param_name, torch::Tensor& t) {
    const Parameter* p = model.Find(param_name);
    if (p == nullptr) {
      return !staged || model.OwningStage(param_name, /*stages=*/1) < 0;
    }
    if (t.sizes() == c10::IntArrayRef(p->full_shape)) {
      t = model.LocalShard(*p, t);
    }
    return true;
  };
  for (NamedTensors* tensors : {&contents.weights, &contents.optimizer_state}) {
    NamedTensors kept;
    for (auto& [name, t] : *tensors) {
      const std::string param =
          tensors == &contents.weights ? name : name.substr(0, name.rfind('.'));
      if (localize(param, t)) kept.emplace_back(name, std::move(t));
    }
    *tensors = std::move(kept);
  }
  return absl::OkStatus();
}

// `contents` as this rank's shards of `model` (KeepLocalShards when the
// model is split across ranks).
absl::Status LocalizeFor(const CausalLm& model, const EngineGroups& groups,
                         CheckpointContents& contents) {
  if (!Staged(model, groups)) return absl::OkStatus();
  return KeepLocalShards(model, groups.pp->size() > 1, contents);
}

// What an adapter's checkpoint records of its base's directory (see
// CheckpointManifest::base_identity): its identity when the model was
// created, which `base_key` holds; a marker no identity equals once the
// directory was published over since (a resume then refuses it).
std::string BaseIdentity(const ModelSpec& spec, const std::string& base_key) {
  if (!spec.lora.enabled() || spec.init_checkpoint.empty()) return "";
  std::string identity = DirectoryIdentity(spec.init_checkpoint);
  if (BaseKey(spec, identity) != base_key) {
    identity = "changed after the model was created";
  }
  return identity;
}

// A LoRA model loads its own kind of adapter checkpoint only: anything
// holding base weights would write into the base its other adapters share.
absl::Status CheckAdapterCheckpoint(const CheckpointContents& contents,
                                    const LoraConfig& lora,
                                    const std::string& path) {
  const LoraConfig none;
  const LoraConfig& saved = contents.manifest ? contents.manifest->lora : none;
  if (!lora.enabled() && !saved.enabled()) return absl::OkStatus();
  if (!lora.enabled()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " holds a LoRA adapter; load it into a model with that lora"));
  }
  const bool factors_only =
      std::all_of(contents.weights.begin(), contents.weights.end(),
                  [](const auto& w) { return IsLoraParameter(w.first); });
  if (!saved.enabled() || !contents.manifest->trainable_only || !factors_only) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        " is not a checkpoint of a LoRA adapter; a LoRA model loads only "
        "those (its base is shared)"));
  }
  if (!SameAdapterShape(saved, lora)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " holds an adapter of rank ", saved.rank, ", alpha ", saved.alpha,
        " on other modules or scale than the model's (rank ", lora.rank,
        ", alpha ", lora.alpha, ")"));
  }
  return absl::OkStatus();
}

// What init_checkpoint says of `spec` when it is not a shared base in
// memory: INVALID_ARGUMENT for an adapter's checkpoint (no base) or a
// trainable-only one as a LoRA base; ABORTED when a LoRA base's directory
// no longer holds what `base_key` names.
absl::Status CheckInitCheckpoint(const ModelSpec& spec,
                                 const std::string& base_key,
                                 const CheckpointContents& init) {
  const std::optional<CheckpointManifest>& m = init.manifest;
  if (m && m->lora.enabled()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init_checkpoint ", spec.init_checkpoint,
        " holds a LoRA adapter without its base: create the model with "
        "init_checkpoint set to its base (",
        m->base_checkpoint.empty() ? "drawn from its config and seed"
                                   : m->base_checkpoint,
        ") and lora (rank ", m->lora.rank, ", alpha ", m->lora.alpha,
        ") with init_adapter ", spec.init_checkpoint));
  }
  if (m && m->trainable_only && spec.lora.enabled()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init_checkpoint ", spec.init_checkpoint,
        " holds the trainable parameters only: a LoRA base must be a "
        "whole model"));
  }
  // The base about to be built is shared under `base_key`: it must hold
  // what the key names, not a directory published over it meanwhile.
  if (spec.lora.enabled() && CurrentBaseKey(spec) != base_key) {
    return absl::AbortedError(
        absl::StrCat("init_checkpoint ", spec.init_checkpoint,
                     " changed while it was read; nothing was created: retry"));
  }
  return absl::OkStatus();
}

// The family step: `spec`'s init_checkpoint, read unless it is a shared base
// in memory (then nullopt), and spec.config set from it. INVALID_ARGUMENT
// for a config that differs from the checkpoint's.
absl::StatusOr<std::optional<CheckpointContents>> ReadInitCheckpoint(
    ModelSpec& spec, const std::string& base_key, const SharedBases& bases) {
  if (spec.init_checkpoint.empty()) return std::nullopt;
  // A base already in memory is not read again.
  const std::shared_ptr<const CausalLm> base = bases.Find(base_key);
  std::optional<CheckpointContents> init;
  if (base == nullptr) {
    TALLY_ASSIGN_OR_RETURN(init, ReadCheckpoint(spec.init_checkpoint,
                                                /*read_optimizer=*/false));
    TALLY_RETURN_IF_ERROR(CheckInitCheckpoint(spec, base_key, *init));
  }
  const LlamaConfig& source = base ? base->config() : init->config;
  const bool config_given = spec.config.vocab_size != 0;
  if (config_given && spec.config.WithDefaults() != source) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config differs from the config.json of init_checkpoint ",
        spec.init_checkpoint, "; omit config to use the checkpoint's"));
  }
  spec.config = source;
  return init;
}

// The config and adapter of `spec` with their defaults, validated before
// anything is built for them.
absl::Status ResolveSpec(ModelSpec& spec) {
  spec.config = spec.config.WithDefaults();
  TALLY_RETURN_IF_ERROR(spec.config.Validate());
  if (!spec.lora.enabled()) return absl::OkStatus();
  spec.lora = spec.lora.WithDefaults();
  if (!spec.lora.seed) spec.lora.seed = spec.seed;
  TALLY_RETURN_IF_ERROR(ValidateLoraConfig(spec.lora));
  return ValidateLoraForModel(spec.config, spec.lora);
}

ModelSharding ShardingOver(const EngineGroups& groups, ZeroStage zero_stage) {
  ModelSharding sharding;
  sharding.tp = groups.tp;
  sharding.dp_shard = groups.dp_shard;
  sharding.zero_stage = zero_stage;
  sharding.cp = groups.cp;
  sharding.ep = groups.ep;
  sharding.pp_stage = groups.pp->rank();
  sharding.pp_stages = groups.pp->size();
  return sharding;
}

// Loads `contents` into this rank's shards of `model`.
absl::Status LoadInto(const CheckpointContents& contents, CausalLm& model,
                      const EngineGroups& groups) {
  CheckpointContents local = contents;
  TALLY_RETURN_IF_ERROR(LocalizeFor(model, groups, local));
  return LoadWeightsInto(local, model);
}

// The converter step of a LoRA model: its factors (from lora.init_adapter
// when set) over `base`.
absl::StatusOr<std::unique_ptr<CausalLm>> BuildAdapter(
    const ModelSpec& spec, const ModelSharding& sharding,
    std::shared_ptr<const CausalLm> base, const EngineGroups& groups) {
  ModelAdapters adapters;
  adapters.lora = spec.lora;
  adapters.base = std::move(base);
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<CausalLm> model,
      CreateCausalLm(spec.config, spec.dtype, spec.seed, sharding, adapters));
  if (spec.lora.init_adapter.empty()) return model;
  CheckpointContents adapter;
  adapter.config = spec.config;
  adapter.manifest = CheckpointManifest();
  adapter.manifest->trainable_only = true;
  TALLY_ASSIGN_OR_RETURN(adapter.weights, ReadAdapter(spec.lora.init_adapter,
                                                      spec.config, spec.lora));
  const absl::Status loaded = LoadInto(adapter, *model, groups);
  if (!loaded.ok()) {
    return absl::Status(loaded.code(), absl::StrCat("lora.init_adapter ",
                                                    spec.lora.init_adapter,
                                                    ": ", loaded.message()));
  }
  return model;
}

// The model of `spec` (its config resolved) as this rank's shards, loaded
// with `init` when given. A LoRA model shares the base `bases` holds under
// `base_key`, building the base when none is in memory.
absl::StatusOr<std::unique_ptr<CausalLm>> BuildCausalLm(
    const ModelSpec& spec, const std::string& base_key,
    const std::optional<CheckpointContents>& init, const EngineGroups& groups,
    const BuildOptions& options, const SharedBases& bases) {
  const ModelSharding sharding = ShardingOver(groups, options.zero_stage);
  if (!spec.lora.enabled()) {
    TALLY_ASSIGN_OR_RETURN(
        std::unique_ptr<CausalLm> model,
        CreateCausalLm(spec.config, spec.dtype, spec.seed, sharding));
    if (init) TALLY_RETURN_IF_ERROR(LoadInto(*init, *model, groups));
    return model;
  }
  std::shared_ptr<const CausalLm> base = bases.Find(base_key);
  if (base == nullptr) {
    ModelSpec base_spec = spec;
    base_spec.lora = LoraConfig();
    TALLY_ASSIGN_OR_RETURN(
        std::unique_ptr<CausalLm> own,
        BuildCausalLm(base_spec, "", init, groups, options, bases));
    own->FreezeBase();
    base = std::move(own);
  }
  return BuildAdapter(spec, sharding, std::move(base), groups);
}

// The parallelize step's per-rank settings, once the shards exist.
absl::Status Parallelize(const ModelSpec& spec, const BuildOptions& options,
                         CausalLm& model) {
  TALLY_RETURN_IF_ERROR(model.To(options.device));
  TALLY_RETURN_IF_ERROR(FreezeParameters(spec.frozen, model));
  TALLY_RETURN_IF_ERROR(
      model.set_recompute_layers(spec.activation_checkpointing));
  model.set_attention(options.attention);
  if (spec.dtype == DType::kBFloat16 && model.routed_experts() > 0) {
    return absl::InvalidArgumentError(
        "dtype DTYPE_BFLOAT16 is not implemented for mixture-of-experts "
        "models (their routing statistics travel with the activations)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<BuiltModel>> BuildModel(
    ModelSpec spec, const std::string& base_key, const RankContext& rank,
    const BuildOptions& options, const SharedBases& bases) {
  TALLY_RETURN_IF_ERROR(InjectedFault(FaultPoint::kBuildModel));
  TALLY_ASSIGN_OR_RETURN(std::optional<CheckpointContents> init,
                         ReadInitCheckpoint(spec, base_key, bases));
  TALLY_RETURN_IF_ERROR(ResolveSpec(spec));
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<CausalLm> model,
      BuildCausalLm(spec, base_key, init, rank.groups, options, bases));
  TALLY_RETURN_IF_ERROR(Parallelize(spec, options, *model));
  return std::make_unique<BuiltModel>(
      std::move(spec), base_key, std::move(model), rank, options.bucket_bytes);
}

BuiltModel::BuiltModel(ModelSpec spec, std::string base_key,
                       std::unique_ptr<CausalLm> model, const RankContext& rank,
                       int64_t bucket_bytes)
    : spec_(std::move(spec)),
      base_key_(std::move(base_key)),
      model_(std::move(model)),
      optimizer_(
          std::make_unique<Optimizer>(spec_.optimizer, &model_->parameters())),
      rank_(rank),
      gradient_sync_(*model_, rank.groups, bucket_bytes) {}

absl::Status BuiltModel::FinishBuild() {
  return RefreshGathered(ShardsChanged::kCreated);
}

ModelSummary BuiltModel::Describe() const {
  ModelSummary s;
  s.model_id = spec_.model_id;
  s.config = spec_.config;
  s.num_parameters = model_->config().NumParameters();
  s.dtype = spec_.dtype;
  s.optimizer = spec_.optimizer;
  s.default_adam = spec_.default_adam;
  s.default_max_grad_norm = spec_.default_max_grad_norm;
  s.grad_sync = spec_.grad_sync;
  s.activation_checkpointing = spec_.activation_checkpointing;
  s.lora = spec_.lora;
  s.base = base_key_;
  s.trainable_parameters =
      spec_.lora.enabled()
          ? static_cast<uint64_t>(LoraParameterCount(spec_.config, spec_.lora))
          : s.num_parameters;
  s.trainable_bytes = s.trainable_parameters *
                      (MasterDType(spec_.dtype) == DType::kFloat64 ? 8 : 4);
  return s;
}

RankStateBytes BuiltModel::StateBytes() const {
  const std::vector<Parameter>& params = model_->parameters();
  const GatheredBytes gathered = GatheredStateBytes(params);
  RankStateBytes bytes;
  bytes.parameters = gathered.parameters;
  bytes.gradients = gathered.gradients;
  // A mixed-precision model's compute-dtype copies of its weights.
  bytes.parameters += static_cast<double>(model_->ComputeWeightBytes());
  for (const Parameter& p : params) {
    bytes.parameters += p.tensor.nbytes();
    if (p.tensor.grad().defined()) bytes.gradients += p.tensor.grad().nbytes();
  }
  for (const auto& [name, t] : optimizer_->StateTensors()) {
    bytes.optimizer += t.nbytes();
  }
  return bytes;
}

void BuiltModel::ClearGradients() { ZeroGradients(model_->parameters()); }

absl::Status BuiltModel::Step(const AdamParams& hp, double grad_scale) {
  absl::Status stepped = InjectedFault(FaultPoint::kOptimizerUpdate);
  if (stepped.ok()) stepped = optimizer_->Step(hp, grad_scale);
  // The forwards' compute-dtype copies are stale now, also after a failed
  // (partial) update (the optimizer bumps the masters' version counters
  // too; this does not depend on it).
  model_->WeightsChanged();
  stepped = rank_.phases.Agree(stepped);
  if (!stepped.ok()) return stepped;
  return RefreshGathered(ShardsChanged::kStepped);
}

absl::StatusOr<StagedLoad> BuiltModel::StageLoad(const std::string& path,
                                                 bool load_optimizer) {
  StagedLoad staged;
  staged.optimizer =
      std::make_unique<Optimizer>(spec_.optimizer, &model_->parameters());
  TALLY_RETURN_IF_ERROR(InjectedFault(FaultPoint::kLoad));
  CheckpointContents& contents = staged.contents;
  TALLY_ASSIGN_OR_RETURN(
      contents, ReadCheckpoint(path, load_optimizer, &model_->config()));
  TALLY_RETURN_IF_ERROR(CheckAdapterCheckpoint(contents, model_->lora(), path));
  TALLY_RETURN_IF_ERROR(LocalizeFor(*model_, rank_.groups, contents));
  if (load_optimizer) {
    if (!contents.manifest) {
      return absl::FailedPreconditionError(absl::StrCat(
          path,
          " holds no optimizer state (not a tally checkpoint); use "
          "load_optimizer = false"));
    }
    if (contents.manifest->optimizer != spec_.optimizer) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " holds ", OptimizerName(contents.manifest->optimizer),
          " state but model '", spec_.model_id, "' uses ",
          OptimizerName(spec_.optimizer)));
    }
    TALLY_RETURN_IF_ERROR(staged.optimizer->LoadState(
        contents.optimizer_state, contents.manifest->optimizer_step_count));
  }
  TALLY_RETURN_IF_ERROR(ValidateWeightsFor(contents, *model_));
  return staged;
}

absl::Status BuiltModel::ApplyLoad(StagedLoad& staged) {
  // A copy may fail on one rank only; the gathers need every rank's shards.
  const absl::Status loaded = LoadWeightsInto(staged.contents, *model_);
  model_->WeightsChanged();  // also when only some weights were written
  TALLY_RETURN_IF_ERROR(rank_.phases.Agree(loaded));
  TALLY_RETURN_IF_ERROR(RefreshGathered(ShardsChanged::kLoaded));
  optimizer_ = std::move(staged.optimizer);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> BuiltModel::SaveCheckpoint(
    const std::string& path, CheckpointManifest manifest,
    const SaveOptions& options) {
  manifest.default_adam = spec_.default_adam;
  manifest.default_max_grad_norm = spec_.default_max_grad_norm;
  manifest.grad_sync = spec_.grad_sync;
  manifest.activation_checkpointing = spec_.activation_checkpointing;
  manifest.seed = spec_.seed;
  // An adapter's checkpoint holds the adapter: its base is shared and
  // frozen, and comes back from base_checkpoint.
  manifest.trainable_only = options.trainable_only || spec_.lora.enabled();
  manifest.lora = spec_.lora;
  manifest.base_checkpoint = spec_.init_checkpoint;
  manifest.base_identity = BaseIdentity(spec_, base_key_);
  uint64_t bytes = 0;
  TALLY_RETURN_IF_ERROR(consolidation().WriteOnRankZero(
      {*model_, *optimizer_, spec_.frozen},
      {/*with_optimizer_state=*/true, manifest.trainable_only},
      [&](const CausalLm& model, const Optimizer& optimizer) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(bytes,
                               WriteCheckpoint(path, model, optimizer, manifest,
                                               options.server_state));
        return absl::OkStatus();
      }));
  return bytes;
}

absl::StatusOr<ExportResult> BuiltModel::ExportWeights(
    const std::string& path, const ExportOptions& options) {
  ExportResult result;
  // A PEFT export writes the adapter only: the frozen base stays unsent.
  TALLY_RETURN_IF_ERROR(consolidation().WriteOnRankZero(
      {*model_, *optimizer_, spec_.frozen},
      {/*with_optimizer_state=*/false,
       /*trainable_only=*/spec_.lora.enabled() && !options.merge},
      [&](const CausalLm& model, const Optimizer&) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(
            result,
            WriteWeightsExport(path, model, options, spec_.init_checkpoint));
        return absl::OkStatus();
      }));
  return result;
}

absl::Status BuiltModel::RefreshGathered(ShardsChanged changed) {
  if (!model_->sharding().keeps_gathered()) return absl::OkStatus();
  const bool lora = model_->lora().enabled();
  return rank_.phases.Finish(
      RefreshGatheredCopies(model_->parameters(), model_->compute_type(),
                            *rank_.groups.dp_shard, [&](const Parameter& p) {
                              switch (changed) {
                                case ShardsChanged::kCreated:
                                  return !p.gathered->value.defined();
                                case ShardsChanged::kLoaded:
                                  return !lora || IsLoraParameter(p.name);
                                default:
                                  return p.trainable;
                              }
                            }));
}

Consolidation BuiltModel::consolidation() const {
  return Consolidation(rank_.mesh, rank_.groups, rank_.phases);
}

}  // namespace tally
