#include "runtime/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/error_reason.h"
#include "base/status.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/directory_identity.h"
#include "runtime/checkpoint/lora_adapter_reader.h"
#include "runtime/engine/consolidation.h"
#include "runtime/model/freeze_parameters.h"
#include "runtime/model/lora.h"
#include "runtime/parallel/device.h"
#include "runtime/parallel/fault_hook.h"
#include "runtime/parallel/grad_buckets.h"
#include "runtime/parallel/pipeline.h"
#include "runtime/parallel/pipeline_executor.h"
#include "runtime/parallel/zero.h"
#include "runtime/train/call_plan.h"
#include "runtime/train/call_results.h"
#include "runtime/train/loss.h"
#include "runtime/train/loss_registry.h"
#include "runtime/train/loss_report.h"
#include "runtime/train/step_guard.h"
#include "runtime/train/token_loss.h"

namespace tally {
namespace {

// Renames the HF weights of `contents` to the model's parameters, replaces
// the full tensors by this rank's shards of them and, under pp, drops those
// of other stages' parameters. Tensors that match no parameter of the model
// (or not its full shape) are left for LoadWeightsInto / LoadState to
// report.
absl::Status KeepLocalShards(CausalLm& model, bool staged,
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

// A last-stage micro-batch's per-sample results: loss sums and valid
// tokens, and (when `results` holds them) each token's log-probability, put
// back in sample order (a cp rank holds two chunks of each sample).
void RecordSamples(const torch::Tensor& logprobs, const PackedBatch& batch,
                   const AttentionLayout& layout, const LossTerms& terms,
                   CallResults& results) {
  const bool return_logprobs = results.with_logprobs();
  auto loss_sums = terms.sample_loss_sums.accessor<double, 1>();
  auto valid = terms.sample_valid_tokens.accessor<int64_t, 1>();
  torch::Tensor rows, positions;
  if (return_logprobs) {
    rows = logprobs.detach()
               .masked_fill(~batch.has_target, 0.0)
               .to(torch::kCPU, torch::kFloat64)
               .contiguous();
    positions = layout.positions.cpu().contiguous();
  }
  for (size_t r = 0; r < batch.sample_index.size(); ++r) {
    const int i = batch.sample_index[r];
    results.SetSample(i, loss_sums[r], valid[r]);
    if (return_logprobs) {
      results.SetLogprobs(i, rows[r].data_ptr<double>(),
                          positions[r].data_ptr<int64_t>(), batch.lengths[r]);
    }
  }
}

// The channels of `auxiliary` (see AuxiliaryLoss) in a stage boundary.
int64_t AuxiliaryChannels(const std::vector<AuxiliaryLoss>& auxiliary) {
  int64_t channels = 0;
  for (const AuxiliaryLoss& a : auxiliary) channels += a.channels;
  return channels;
}

// This stage's forward of micro-batch b. Between stages flow the hidden
// states [B, T, H] and the channels of the model's auxiliary losses, which
// the last stage turns into per-token terms joining each token's loss, so
// they are weighted and normalized exactly like the token's cross-entropy.
// Returns what the next stage receives or, on the last stage, the raw loss
// to backpropagate.
torch::Tensor ForwardMicroBatch(CausalLm& model, const CallPlan& plan, size_t b,
                                const torch::Tensor& received, bool last,
                                const ForwardBackwardArgs& args,
                                const TokenLoss& loss,
                                const std::vector<AuxiliaryLoss>& auxiliary,
                                CallResults& results) {
  const PackedBatch& batch = plan.packed[b];
  StageIo io;
  if (model.routed_experts() > 0) {
    const torch::Device device = batch.inputs.device();
    io.real_tokens = torch::arange(batch.inputs.size(1), batch.inputs.options())
                         .unsqueeze(0) <
                     torch::tensor(batch.lengths).to(device).unsqueeze(1);
    if (!plan.real(b)) io.real_tokens.fill_(false);
  }
  torch::Tensor input = batch.inputs;
  if (received.defined()) {
    int64_t offset = received.size(-1) - AuxiliaryChannels(auxiliary);
    input = received.narrow(-1, 0, offset);
    for (const AuxiliaryLoss& a : auxiliary) {
      io.auxiliary.push_back(received.narrow(-1, offset, a.channels));
      offset += a.channels;
    }
  }
  torch::Tensor output =
      model.StageForward(input, batch.targets, plan.layouts[b], &io);
  if (io.expert_tokens.defined()) {
    results.expert_tokens().add_(io.expert_tokens.flatten().cpu());
  }
  if (!last) {
    std::vector<torch::Tensor> sent = {output};
    sent.insert(sent.end(), io.auxiliary.begin(),
                io.auxiliary.begin() + auxiliary.size());
    return sent.size() == 1 ? output : torch::cat(sent, -1);
  }
  torch::Tensor loss_logprobs = output;
  const std::vector<torch::Tensor> auxiliary_terms =
      model.AuxiliaryTokenLosses(io);
  for (size_t a = 0; a < auxiliary_terms.size(); ++a) {
    loss_logprobs =
        loss_logprobs - auxiliary[a].coefficient * auxiliary_terms[a];
  }
  const LossTerms terms = ComputeLoss(loss, loss_logprobs, batch,
                                      args.reduction, plan.RowTokens(b));
  if (plan.real(b)) {
    RecordSamples(output, batch, plan.layouts[b], terms, results);
  }
  return terms.raw_loss;
}

// A model's auxiliary losses (MoE load balancing) join each token's loss as
// a term of its log-probability, weighted like cross-entropy: exact for
// cross-entropy with weights >= 0. The policy losses would take the term
// into their importance ratio, and a negative weight would flip its sign:
// INVALID_ARGUMENT naming the field.
absl::Status CheckAuxiliaryLossesApply(const CausalLm& model,
                                       const ForwardBackwardArgs& args) {
  if (model.auxiliary_losses().empty()) return absl::OkStatus();
  constexpr char kWhy[] =
      "is not implemented for a model with a router auxiliary loss "
      "(output_router_logits with router_aux_loss_coef > 0)";
  if (args.loss.name != LossSpec().name) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_fn ", args.loss.name, " ", kWhy,
                     "; use cross_entropy, or turn output_router_logits off"));
  }
  for (size_t i = 0; i < args.samples.size(); ++i) {
    const std::vector<float>& weights = args.samples[i].weights;
    for (size_t t = 0; t < weights.size(); ++t) {
      if (weights[t] >= 0) continue;
      return absl::InvalidArgumentError(
          absl::StrCat("samples[", i, "].weights[", t, "] = ", weights[t],
                       ": a negative weight ", kWhy));
    }
  }
  return absl::OkStatus();
}

// Whether `model`'s forward and backward run collectives inside a stage:
// tensor, context and expert parallelism, ZeRO-3's parameter gathers.
bool CommunicatesInThePass(const CausalLm& model) {
  const ModelSharding& sharding = model.sharding();
  return sharding.tp_size() > 1 || sharding.cp_size() > 1 ||
         sharding.ep_size() > 1 ||
         (sharding.dp_shard_size() > 1 &&
          sharding.zero_stage == ZeroStage::kParameters);
}

// Raises `status` as the exception a torch error would be, inside code that
// reports failures by throwing (the stage callbacks).
void ThrowIfError(const absl::Status& status) {
  TORCH_CHECK(status.ok(), status.ToString());
}

constexpr char kPoisonedTheWindowPayload[] = "tally.dev/poisoned-the-window";

absl::Status MarkPoisonedTheWindow(absl::Status status) {
  status.SetPayload(kPoisonedTheWindowPayload, absl::Cord());
  return status;
}

// Checks `options` and applies what is process-wide (the float32 matmul
// precision) before an engine is built.
absl::Status ApplyEngineOptions(const EngineOptions& options) {
  if (options.max_batch_tokens < 1) {
    return absl::InvalidArgumentError("max_batch_tokens must be >= 1");
  }
  const torch::Device& device = options.device;
  if (device.is_cuda()) {
    const GpuAvailability gpus = DetectGpus();
    const int visible = gpus.visible_gpus;
    if (visible == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "device ", device.str(),
          ": no CUDA device is usable: ", gpus.unavailable_reason));
    }
    if (!device.has_index() || device.index() >= visible) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device ", device.str(), " must name one of the ", visible,
          " visible CUDA devices (cuda:0 to cuda:", visible - 1, ")"));
    }
  } else if (!device.is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device ", device.str(), " is neither cpu nor cuda:<index>"));
  }
  at::globalContext().setAllowTF32CuBLAS(options.allow_tf32);
  return absl::OkStatus();
}

absl::Status NotFound(const std::string& model_id) {
  return absl::NotFoundError(absl::StrCat("model '", model_id, "' not found"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    const EngineOptions& options, Mesh mesh,
    std::unique_ptr<ProcessGroups> groups) {
  TALLY_RETURN_IF_ERROR(ApplyEngineOptions(options));
  if (!groups || groups->world().size() != mesh.world_size() ||
      groups->world().rank() != mesh.rank()) {
    return absl::InvalidArgumentError(
        "the process groups do not match the mesh");
  }
  std::unique_ptr<Engine> engine(new Engine(options, std::move(mesh)));
  EngineGroups& g = engine->groups_;
  g.world = &groups->world();
  TALLY_ASSIGN_OR_RETURN(
      g.data, groups->group({MeshDim::kDpReplicate, MeshDim::kDpShard}));
  TALLY_ASSIGN_OR_RETURN(
      g.data_and_cp,
      groups->group({MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kCp}));
  TALLY_ASSIGN_OR_RETURN(g.replicas,
                         groups->group({MeshDim::kDpReplicate, MeshDim::kCp}));
  TALLY_ASSIGN_OR_RETURN(g.dp_replicate,
                         groups->group({MeshDim::kDpReplicate}));
  TALLY_ASSIGN_OR_RETURN(g.dp_shard, groups->group({MeshDim::kDpShard}));
  TALLY_ASSIGN_OR_RETURN(g.cp, groups->group({MeshDim::kCp}));
  TALLY_ASSIGN_OR_RETURN(g.tp, groups->group({MeshDim::kTp}));
  g.ep = &groups->expert_parallel();
  g.expert_replicas = &groups->expert_data_parallel();
  TALLY_ASSIGN_OR_RETURN(g.pp, groups->group({MeshDim::kPp}));
  engine->control_ = &groups->control();
  engine->process_groups_ = std::move(groups);
  return engine;
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::CreateSingleRank(
    const EngineOptions& options) {
  TALLY_RETURN_IF_ERROR(ApplyEngineOptions(options));
  std::unique_ptr<Engine> engine(new Engine(options, Mesh::SingleRank()));
  TALLY_ASSIGN_OR_RETURN(engine->single_rank_world_,
                         MakeSingleRankCommunicator(options.device));
  Communicator* world = engine->single_rank_world_.get();
  engine->groups_ = {world, world, world, world, world, world,
                     world, world, world, world, world};
  engine->control_ = world;
  return engine;
}

Engine::~Engine() = default;

bool PoisonedTheWindow(const absl::Status& status) {
  return status.GetPayload(kPoisonedTheWindowPayload).has_value();
}

absl::StatusOr<Engine::ModelState*> Engine::Find(const std::string& model_id) {
  auto it = models_.find(model_id);
  if (it == models_.end()) return NotFound(model_id);
  return it->second.get();
}

absl::StatusOr<const Engine::ModelState*> Engine::Find(
    const std::string& model_id) const {
  auto it = models_.find(model_id);
  if (it == models_.end()) return NotFound(model_id);
  return it->second.get();
}

absl::StatusOr<CausalLm*> Engine::model(const std::string& model_id) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  return state->model.get();
}

absl::StatusOr<Optimizer*> Engine::optimizer(const std::string& model_id) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  return state->optimizer.get();
}

ModelSummary Engine::Summarize(const ModelState& state) {
  ModelSummary s;
  s.model_id = state.spec.model_id;
  s.config = state.spec.config;
  s.num_parameters = state.model->config().NumParameters();
  s.step = state.step;
  s.window = state.window.counts();
  s.dtype = state.spec.dtype;
  s.optimizer = state.spec.optimizer;
  s.default_adam = state.spec.default_adam;
  s.default_max_grad_norm = state.spec.default_max_grad_norm;
  s.grad_sync = state.spec.grad_sync;
  s.activation_checkpointing = state.spec.activation_checkpointing;
  s.lora = state.spec.lora;
  s.base = state.base_key;
  s.trainable_parameters = state.spec.lora.enabled()
                               ? static_cast<uint64_t>(LoraParameterCount(
                                     state.spec.config, state.spec.lora))
                               : s.num_parameters;
  s.trainable_bytes =
      s.trainable_parameters *
      (MasterDType(state.spec.dtype) == DType::kFloat64 ? 8 : 4);
  s.damage = state.damage;
  return s;
}

absl::StatusOr<ModelSummary> Engine::CreateModel(const ModelSpec& request) {
  ModelSpec spec = request;
  if (spec.model_id.empty() || spec.model_id.back() == '/') {
    const std::string scope = spec.model_id;
    do {
      spec.model_id = absl::StrCat(scope, "model-", next_auto_id_++);
    } while (models_.count(spec.model_id));
  }
  if (models_.count(spec.model_id)) {
    return ReasonError(
        ErrorReason::kModelExists,
        absl::StrCat("model '", spec.model_id, "' already exists"));
  }
  TALLY_RETURN_IF_ERROR(ValidateAdamParams(spec.default_adam, "default_adam"));
  TALLY_RETURN_IF_ERROR(
      ValidateMaxGradNorm(spec.default_max_grad_norm, "default_max_grad_norm"));
  // Each rank reads init_checkpoint's identity itself: they agree on the key
  // before any of them looks its base up.
  const std::string base_key = CurrentBaseKey(spec);
  TALLY_RETURN_IF_ERROR(AgreeOnBaseKey(*groups_.world, spec, base_key));
  // Building can fail on one rank only (an unreadable init_checkpoint, memory):
  // the ranks agree before any of them adds the model.
  absl::StatusOr<std::unique_ptr<ModelState>> built =
      BuildModel(spec, base_key);
  TALLY_RETURN_IF_ERROR(phases().Agree(built.status()));
  std::unique_ptr<ModelState> state = *std::move(built);
  // Gathered only now: a rank that failed to build would never reach the
  // gathers.
  TALLY_RETURN_IF_ERROR(
      RefreshGathered(*state->model, ShardsChanged::kCreated));
  if (state->model->base() != nullptr) {
    bases_[state->base_key] = state->model->base();
  }
  ModelSummary summary = Summarize(*state);
  models_[state->spec.model_id] = std::move(state);
  return summary;
}

absl::StatusOr<std::unique_ptr<Engine::ModelState>> Engine::BuildModel(
    ModelSpec spec, const std::string& base_key) {
  TALLY_RETURN_IF_ERROR(InjectedFault(FaultPoint::kBuildModel));
  TALLY_ASSIGN_OR_RETURN(std::optional<CheckpointContents> init,
                         ReadInitCheckpoint(spec, base_key));
  spec.config = spec.config.WithDefaults();
  TALLY_RETURN_IF_ERROR(spec.config.Validate());
  if (spec.lora.enabled()) {
    spec.lora = spec.lora.WithDefaults();
    if (!spec.lora.seed) spec.lora.seed = spec.seed;
    // Before a base is built for it.
    TALLY_RETURN_IF_ERROR(ValidateLoraConfig(spec.lora));
    TALLY_RETURN_IF_ERROR(ValidateLoraForModel(spec.config, spec.lora));
  }

  auto state = std::make_unique<ModelState>();
  state->base_key = base_key;
  TALLY_ASSIGN_OR_RETURN(state->model, BuildCausalLm(spec, base_key, init));
  TALLY_RETURN_IF_ERROR(state->model->To(options_.device));
  TALLY_RETURN_IF_ERROR(FreezeParameters(spec.frozen, *state->model));
  TALLY_RETURN_IF_ERROR(
      state->model->set_recompute_layers(spec.activation_checkpointing));
  state->model->set_attention(options_.attention);
  if (spec.dtype == DType::kBFloat16 && state->model->routed_experts() > 0) {
    return absl::InvalidArgumentError(
        "dtype DTYPE_BFLOAT16 is not implemented for mixture-of-experts "
        "models (their routing statistics travel with the activations)");
  }
  state->optimizer =
      std::make_unique<Optimizer>(spec.optimizer, &state->model->parameters());
  state->spec = std::move(spec);
  return state;
}

absl::StatusOr<std::optional<CheckpointContents>> Engine::ReadInitCheckpoint(
    ModelSpec& spec, const std::string& base_key) const {
  if (spec.init_checkpoint.empty()) return std::nullopt;
  // A LoRA base already in memory is not read again.
  const std::shared_ptr<const CausalLm> base = SharedBase(base_key);
  std::optional<CheckpointContents> init;
  if (base == nullptr) {
    TALLY_ASSIGN_OR_RETURN(init, ReadCheckpoint(spec.init_checkpoint,
                                                /*read_optimizer=*/false));
    const std::optional<CheckpointManifest>& m = init->manifest;
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
      return absl::AbortedError(absl::StrCat(
          "init_checkpoint ", spec.init_checkpoint,
          " changed while it was read; nothing was created: retry"));
    }
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

absl::StatusOr<std::unique_ptr<CausalLm>> Engine::BuildCausalLm(
    const ModelSpec& spec, const std::string& base_key,
    const std::optional<CheckpointContents>& init) {
  ModelSharding sharding;
  sharding.tp = groups_.tp;
  sharding.dp_shard = groups_.dp_shard;
  sharding.zero_stage = options_.zero_stage;
  sharding.cp = groups_.cp;
  sharding.ep = groups_.ep;
  sharding.pp_stage = groups_.pp->rank();
  sharding.pp_stages = groups_.pp->size();
  // Loads `contents` into this rank's shards of `model`.
  auto load = [&](const CheckpointContents& contents,
                  CausalLm& model) -> absl::Status {
    CheckpointContents local = contents;
    if (Staged(model, groups_)) {
      TALLY_RETURN_IF_ERROR(
          KeepLocalShards(model, groups_.pp->size() > 1, local));
    }
    return LoadWeightsInto(local, model);
  };
  if (!spec.lora.enabled()) {
    TALLY_ASSIGN_OR_RETURN(
        std::unique_ptr<CausalLm> model,
        CreateCausalLm(spec.config, spec.dtype, spec.seed, sharding));
    if (init) TALLY_RETURN_IF_ERROR(load(*init, *model));
    return model;
  }
  ModelAdapters adapters;
  adapters.lora = spec.lora;
  adapters.base = SharedBase(base_key);
  if (adapters.base == nullptr) {
    ModelSpec base_spec = spec;
    base_spec.lora = LoraConfig();
    TALLY_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> base,
                           BuildCausalLm(base_spec, "", init));
    base->FreezeBase();
    adapters.base = std::move(base);
  }
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<CausalLm> model,
      CreateCausalLm(spec.config, spec.dtype, spec.seed, sharding, adapters));
  if (!spec.lora.init_adapter.empty()) {
    CheckpointContents adapter;
    adapter.config = spec.config;
    adapter.manifest = CheckpointManifest();
    adapter.manifest->trainable_only = true;
    TALLY_ASSIGN_OR_RETURN(
        adapter.weights,
        ReadAdapter(spec.lora.init_adapter, spec.config, spec.lora));
    const absl::Status loaded = load(adapter, *model);
    if (!loaded.ok()) {
      return absl::Status(loaded.code(), absl::StrCat("lora.init_adapter ",
                                                      spec.lora.init_adapter,
                                                      ": ", loaded.message()));
    }
  }
  return model;
}

std::shared_ptr<const CausalLm> Engine::SharedBase(
    const std::string& base_key) const {
  auto it = bases_.find(base_key);
  return it == bases_.end() ? nullptr : it->second.lock();
}

bool Engine::HasBase(const std::string& base_key) const {
  return SharedBase(base_key) != nullptr;
}

std::optional<LlamaConfig> Engine::BaseConfig(
    const std::string& base_key) const {
  const std::shared_ptr<const CausalLm> base = SharedBase(base_key);
  if (base == nullptr) return std::nullopt;
  return base->config();
}

absl::StatusOr<ModelSummary> Engine::GetModel(
    const std::string& model_id) const {
  TALLY_ASSIGN_OR_RETURN(const ModelState* state, Find(model_id));
  return Summarize(*state);
}

std::vector<ModelSummary> Engine::ListModels() const {
  std::vector<ModelSummary> out;
  for (const auto& [id, state] : models_) out.push_back(Summarize(*state));
  return out;
}

absl::StatusOr<ModelSummary> Engine::DeleteModel(const std::string& model_id) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  ModelSummary summary = Summarize(*state);
  models_.erase(model_id);
  // The last adapter of a base took it along.
  for (auto it = bases_.begin(); it != bases_.end();) {
    it = it->second.expired() ? bases_.erase(it) : std::next(it);
  }
  return summary;
}

absl::StatusOr<ForwardBackwardResult> Engine::ForwardBackward(
    const std::string& model_id, const ForwardBackwardArgs& args) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_RETURN_IF_ERROR(CheckIntact(*state));
  TALLY_RETURN_IF_ERROR(ValidateSamples(state->spec.config, args.samples));
  TALLY_ASSIGN_OR_RETURN(const std::shared_ptr<const TokenLoss> loss,
                         MakeTokenLoss(args.loss));
  TALLY_RETURN_IF_ERROR(ValidateLossInputs(*loss, args.samples));
  TALLY_RETURN_IF_ERROR(CheckAuxiliaryLossesApply(*state->model, args));
  if (!args.forward_only) {
    TALLY_RETURN_IF_ERROR(state->window.CheckReduction(args.reduction));
  }
  absl::StatusOr<ForwardBackwardResult> result =
      RunForwardBackward(*state, args, *loss);
  if (absl::Status finished = phases().Finish(result.status());
      !finished.ok()) {
    result = std::move(finished);
  }
  // Validation passed, so a failure here happened mid-computation, possibly
  // after some micro-batches added their gradients.
  if (!result.ok() && !args.forward_only &&
      Poison(*state, absl::StrCat("a ForwardBackward failed after it may have "
                                  "added gradients: ",
                                  result.status().message()))) {
    return MarkPoisonedTheWindow(result.status());
  }
  return result;
}

absl::StatusOr<ForwardBackwardResult> Engine::RunForwardBackward(
    ModelState& state, const ForwardBackwardArgs& args, const TokenLoss& loss) {
  const absl::Time start = absl::Now();
  CausalLm& model = *state.model;
  const LlamaConfig& config = model.config();
  CallPlanOptions plan_options;
  plan_options.reduction = args.reduction;
  plan_options.dtype = model.scalar_type();
  plan_options.pipeline_parts = options_.pp_microbatches > 0
                                    ? options_.pp_microbatches
                                    : groups_.pp->size();
  plan_options.max_batch_tokens = options_.max_batch_tokens;
  plan_options.device = options_.device;
  TALLY_ASSIGN_OR_RETURN(
      const CallPlan plan,
      PlanCall(args.samples, plan_options, *groups_.data, *groups_.cp));

  // This call's gradients are summed over the replicas on their own (EAGER,
  // or a DEFERRED window already summed): the earlier calls' are set aside
  // meanwhile, and the sum may start during the last backward.
  const bool sync_call =
      !args.forward_only && NeedsGradientSync(model) &&
      (state.spec.grad_sync == GradSync::kEager || state.replicas_summed);
  std::vector<torch::Tensor> earlier;
  std::unique_ptr<OverlappedGradientSum> overlapped;
  std::vector<Communicator*> overlapped_groups;
  if (sync_call) {
    for (Parameter& p : model.parameters()) {
      earlier.push_back(p.tensor.grad());
      p.tensor.mutable_grad() = torch::Tensor();
    }
    std::vector<GradientSet> replica_sets =
        ReplicaGradientSets(model.parameters());
    // Nothing to overlap when only a tied embedding needs its stages' sum,
    // nor under ZeRO-1, whose shards get their gradients after backward.
    if (options_.overlap_grad_sync && !replica_sets.empty() &&
        !KeepsWholeGradients(model.parameters())) {
      for (const GradientSet& set : replica_sets) {
        overlapped_groups.push_back(set.group);
      }
      TALLY_ASSIGN_OR_RETURN(
          overlapped, OverlappedGradientSum::Create(std::move(replica_sets),
                                                    options_.bucket_mb << 20));
    }
  }

  CallResults results(args.samples, WantsLogprobs(args),
                      config.num_hidden_layers, model.routed_experts());
  const bool last = groups_.pp->rank() == groups_.pp->size() - 1;
  const std::vector<AuxiliaryLoss> auxiliary = model.auxiliary_losses();
  StageCallbacks stage;
  stage.boundary_like = [&](size_t b) {
    // Hidden states and a channel per auxiliary loss.
    const torch::Tensor& ids = plan.packed[b].inputs;
    const int64_t channels = config.hidden_size + AuxiliaryChannels(auxiliary);
    return torch::empty({ids.size(0), ids.size(1), channels},
                        ids.options().dtype(model.compute_type()));
  };
  stage.forward = [&](size_t b, const torch::Tensor& received) {
    ThrowIfError(InjectedFault(FaultPoint::kForward));
    return ForwardMicroBatch(model, plan, b, received, last, args, loss,
                             auxiliary, results);
  };
  stage.before_backward = [&](size_t b) {
    ThrowIfError(InjectedFault(FaultPoint::kBackward));
    // Earlier backwards only accumulate into what the last one sums.
    if (overlapped && b + 1 == plan.num_batches()) overlapped->Arm();
  };
  // Its peers may wait in a collective inside the pass that this rank will
  // not join. (Else the schedule's own agreements and transfers of zeros
  // let every rank finish, gradient sums in flight included.)
  if (CommunicatesInThePass(model)) {
    stage.failed = [&](const absl::Status& failure) {
      phases().FailFast(failure);
    };
  }
  // The last backward starts the gradient sums: its replicas agree first,
  // so that none starts a sum that a replica which failed would not join.
  if (overlapped) {
    stage.agree = [&](absl::Status so_far) {
      for (Communicator* group : overlapped_groups) {
        so_far = phases().AgreeUnlessFailed(*group, std::move(so_far));
      }
      return so_far;
    };
  }
  TALLY_RETURN_IF_ERROR(phases().Agree(RunStageSchedule(
      *groups_.pp, plan.num_batches(), !args.forward_only, stage)));
  TALLY_RETURN_IF_ERROR(results.SumOver(*groups_.data_and_cp));
  // Only the last stage computed the results (zeros elsewhere): every rank,
  // rank 0 on stage 0 included, gets the same numbers and normalizer.
  TALLY_RETURN_IF_ERROR(results.SumOver(*groups_.pp));
  if (sync_call) {
    TALLY_RETURN_IF_ERROR(
        SyncCallGradients(model, std::move(earlier), overlapped.get()));
  }

  ForwardBackwardResult result = results.Unpack(args.reduction);
  ReportLoss(loss, args, result);
  if (!args.forward_only) {
    state.window.Add(args.reduction, result.valid_tokens, result.num_samples);
  }
  result.window = state.window.counts();
  int64_t padded_tokens = 0;
  for (size_t b = 0; b < plan.real_batches; ++b) {
    padded_tokens += plan.packed[b].inputs.numel();
  }
  result.metrics["micro_batches"] = static_cast<double>(plan.num_batches());
  result.metrics["padded_tokens"] = static_cast<double>(padded_tokens);
  result.metrics["seconds"] = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

RankPhases Engine::phases() const {
  return RankPhases(process_groups_.get(), *groups_.world);
}

Consolidation Engine::consolidation() const {
  return Consolidation(mesh_, groups_, phases());
}

bool Engine::NeedsGradientSync(CausalLm& model) const {
  return KeepsWholeGradients(model.parameters()) ||
         groups_.replicas->size() > 1 ||
         (model.routed_experts() > 0 && groups_.expert_replicas->size() > 1) ||
         model.SplitTiedEmbedding() != nullptr;
}

std::vector<GradientSet> Engine::ReplicaGradientSets(
    const std::vector<Parameter>& params) const {
  GradientSet dense{groups_.replicas, {}};
  GradientSet expert{groups_.expert_replicas, {}};
  for (const Parameter& p : params) {
    if (!p.trainable) continue;  // no gradient to sum
    (p.is_expert ? expert : dense).parameters.push_back(p);
  }
  std::vector<GradientSet> sets;
  for (GradientSet* set : {&dense, &expert}) {
    if (set->group->size() > 1 && !set->parameters.empty()) {
      sets.push_back(std::move(*set));
    }
  }
  return sets;
}

absl::Status Engine::SyncGradients(CausalLm& model,
                                   OverlappedGradientSum* overlapped) {
  // ZeRO-1: the window's (or call's) whole gradients into the shards first,
  // so that the replicas sum shards as under every other stage.
  if (KeepsWholeGradients(model.parameters())) {
    TALLY_RETURN_IF_ERROR(
        ReduceWholeGradients(model.parameters(), *groups_.dp_shard));
  }
  // Each replica set in flat buckets. Copies of a Parameter share its
  // tensor, so the sums land in the model.
  if (overlapped != nullptr) {
    TALLY_RETURN_IF_ERROR(overlapped->Finish());
  } else {
    for (GradientSet& set : ReplicaGradientSets(model.parameters())) {
      TALLY_RETURN_IF_ERROR(AllReduceGradientsInBuckets(
          set.parameters, *set.group, options_.bucket_mb << 20));
    }
  }
  Parameter* tied = model.SplitTiedEmbedding();
  if (tied == nullptr) return absl::OkStatus();
  // The first and last stage swap their (replica-summed) gradients of the
  // tied embedding and each adds the two: IEEE addition commutes, so both
  // copies get the same bits and stay identical after the step.
  const int peer = model.first_stage() ? groups_.pp->size() - 1 : 0;
  torch::Tensor own = tied->tensor.grad().defined()
                          ? tied->tensor.grad()
                          : torch::zeros_like(tied->tensor);
  torch::Tensor other = torch::empty_like(own);
  TALLY_RETURN_IF_ERROR(groups_.pp->SendRecv(own, peer, other, peer));
  return CatchTorch("sum the tied embedding", [&] {
    torch::NoGradGuard no_grad;
    tied->tensor.mutable_grad() = own + other;
  });
}

absl::Status Engine::SyncCallGradients(CausalLm& model,
                                       std::vector<torch::Tensor> earlier,
                                       OverlappedGradientSum* overlapped) {
  TALLY_RETURN_IF_ERROR(SyncGradients(model, overlapped));
  std::vector<Parameter>& params = model.parameters();
  return CatchTorch("accumulate gradients", [&] {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!earlier[i].defined()) continue;
      torch::Tensor& grad = params[i].tensor.mutable_grad();
      grad = grad.defined() ? grad.add_(earlier[i]) : earlier[i];
    }
  });
}

absl::Status Engine::RefreshGathered(CausalLm& model, ShardsChanged changed) {
  if (!model.sharding().keeps_gathered()) return absl::OkStatus();
  const bool lora = model.lora().enabled();
  return phases().Finish(
      RefreshGatheredCopies(model.parameters(), model.compute_type(),
                            *groups_.dp_shard, [&](const Parameter& p) {
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

void Engine::ClearWindow(ModelState& state) {
  ZeroGradients(state.model->parameters());
  state.window.Clear();
  state.poisoned = false;
  state.poison_reason.clear();
  state.replicas_summed = false;
}

absl::Status Engine::CheckIntact(const ModelState& state) {
  if (state.damage.empty()) return absl::OkStatus();
  return ReasonError(
      ErrorReason::kModelDamaged,
      absl::StrCat("model '", state.spec.model_id,
                   "' may have partly updated parameters: ", state.damage,
                   "; LoadCheckpoint a checkpoint to restore it"));
}

bool Engine::Poison(ModelState& state, std::string reason) {
  if (state.poisoned) return false;  // the first cause is the one to report
  state.poisoned = true;
  state.poison_reason = std::move(reason);
  return true;
}

absl::StatusOr<bool> Engine::PoisonWindow(const std::string& model_id,
                                          const std::string& reason) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  return Poison(*state, reason);
}

absl::StatusOr<bool> Engine::WindowPoisoned(const std::string& model_id) const {
  TALLY_ASSIGN_OR_RETURN(const ModelState* state, Find(model_id));
  return state->poisoned;
}

absl::Status Engine::CollectiveFailure() const {
  return phases().CollectiveFailure();
}

absl::StatusOr<OptimStepResult> Engine::OptimStep(const std::string& model_id,
                                                  const OptimStepArgs& args) {
  const absl::Time start = absl::Now();
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_RETURN_IF_ERROR(CheckIntact(*state));
  if (state->poisoned) {
    return ReasonError(
        ErrorReason::kWindowPoisoned,
        absl::StrCat("the accumulation window is poisoned (",
                     state->poison_reason,
                     "); call AbortAccumulation and resend the window"));
  }
  if (state->spec.optimizer == OptimizerKind::kSgd &&
      (args.adam.beta1 || args.adam.beta2 || args.adam.eps)) {
    return absl::InvalidArgumentError(
        "adam.beta1, adam.beta2 and adam.eps do not apply to an SGD model");
  }
  const AdamParams hp = args.adam.ResolveAgainst(state->spec.default_adam);
  TALLY_RETURN_IF_ERROR(ValidateAdamParams(hp, "adam"));
  const double max_norm =
      args.max_grad_norm.value_or(state->spec.default_max_grad_norm);
  TALLY_RETURN_IF_ERROR(ValidateMaxGradNorm(max_norm, "max_grad_norm"));
  if (state->window.empty()) {
    return absl::FailedPreconditionError(
        "nothing accumulated: call ForwardBackward before OptimStep");
  }
  const double normalizer = state->window.Normalizer();
  if (normalizer == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the window of ", state->window.counts().calls,
        " calls has no valid token; refusing to step on zero gradients "
        "(call AbortAccumulation or add data)"));
  }

  std::vector<Parameter>& params = state->model->parameters();
  if (state->spec.grad_sync == GradSync::kDeferred && !state->replicas_summed) {
    // Every rank ends the phase, as it agrees over the world: a middle
    // pipeline stage may have nothing to sum while the others sum.
    absl::Status summed = phases().Finish(NeedsGradientSync(*state->model)
                                              ? SyncGradients(*state->model)
                                              : absl::OkStatus());
    // A partial sum cannot be undone: the window is no longer trustworthy.
    if (!summed.ok()) {
      const bool poisoned =
          Poison(*state, absl::StrCat("summing the window over replicas "
                                      "failed: ",
                                      summed.message()));
      return poisoned ? MarkPoisonedTheWindow(summed) : summed;
    }
    state->replicas_summed = true;
  }
  absl::Status norm_ready = InjectedFault(FaultPoint::kGradNorm);
  absl::StatusOr<ClipResult> clipped =
      norm_ready.ok() ? ComputeClip(params, normalizer, mesh_, *groups_.world,
                                    args.norm_type, max_norm)
                      : norm_ready;
  // Nothing changed yet: a failure keeps the window.
  TALLY_RETURN_IF_ERROR(phases().Finish(clipped.status()));
  const ClipResult& clip = *clipped;
  OptimStepResult result;
  result.grad_norm = clip.norm.total;
  result.clip_coef = clip.clip_coef;
  result.normalizer = normalizer;
  result.learning_rate = hp.learning_rate;
  result.metrics["grad_norm_dense"] = clip.norm.dense;
  result.metrics["grad_norm_expert"] = clip.norm.expert;
  result.metrics["window_calls"] =
      static_cast<double>(state->window.counts().calls);
  // This rank's share of the training state (1/S of it under dp_shard = S).
  // Under ZeRO-1/2 also the gathered copies (and ZeRO-1's whole gradients).
  const GatheredBytes gathered = GatheredStateBytes(params);
  double param_bytes = gathered.parameters, grad_bytes = gathered.gradients;
  double optimizer_bytes = 0;
  for (const Parameter& p : params) {
    param_bytes += p.tensor.nbytes();
    if (p.tensor.grad().defined()) grad_bytes += p.tensor.grad().nbytes();
  }
  for (const auto& [name, t] : state->optimizer->StateTensors()) {
    optimizer_bytes += t.nbytes();
  }
  result.metrics["rank_param_bytes"] = param_bytes;
  result.metrics["rank_grad_bytes"] = grad_bytes;
  result.metrics["rank_optimizer_bytes"] = optimizer_bytes;
  // Decided from the agreed norm: the same verdict on every rank.
  if (const std::optional<std::string> reason = UnsafeStepReason(
          clip, hp, state->spec.optimizer, state->spec.dtype)) {
    if (args.nonfinite == NonFinitePolicy::kError) {
      return absl::FailedPreconditionError(absl::StrCat(
          *reason,
          "; nothing changed and the window is kept (policy ERROR); "
          "call AbortAccumulation to discard it"));
    }
    ClearWindow(*state);
    result.skipped = true;
    result.skip_reason = *reason;
    result.step = state->step;
    result.metrics["seconds"] = absl::ToDoubleSeconds(absl::Now() - start);
    return result;
  }
  absl::Status stepped = InjectedFault(FaultPoint::kOptimizerUpdate);
  if (stepped.ok()) stepped = state->optimizer->Step(hp, clip.grad_scale);
  stepped = phases().Agree(stepped);
  if (stepped.ok()) {
    stepped = RefreshGathered(*state->model, ShardsChanged::kStepped);
  }
  ClearWindow(*state);
  if (!stepped.ok()) {
    // Some parameters (on some rank) may have taken the update already.
    state->damage = absl::StrCat(
        "an OptimStep failed while updating the parameters of "
        "step ",
        state->step + 1, " (", stepped.message(), ")");
    return absl::Status(
        stepped.code(),
        absl::StrCat(state->damage,
                     "; the parameters may be partly updated, so the model "
                     "refuses ForwardBackward, OptimStep and SaveCheckpoint "
                     "until a LoadCheckpoint restores it"));
  }
  result.step = ++state->step;
  result.metrics["seconds"] = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

absl::StatusOr<WindowCounts> Engine::AbortAccumulation(
    const std::string& model_id) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  WindowCounts discarded = state->window.counts();
  ClearWindow(*state);
  return discarded;
}

absl::StatusOr<SaveResult> Engine::SaveCheckpoint(const std::string& model_id,
                                                  const std::string& path,
                                                  const SaveOptions& options) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_RETURN_IF_ERROR(CheckIntact(*state));
  const WindowCounts pending = state->window.counts();
  if ((pending.calls > 0 || state->poisoned) && !options.allow_pending) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model '", model_id, "' has a pending accumulation window (",
        pending.calls, " calls, ", pending.tokens,
        " tokens) whose gradients a checkpoint does not hold; call OptimStep "
        "or AbortAccumulation first, or set allow_pending to save without "
        "them"));
  }
  CheckpointManifest manifest;
  manifest.step = state->step;
  manifest.default_adam = state->spec.default_adam;
  manifest.default_max_grad_norm = state->spec.default_max_grad_norm;
  manifest.grad_sync = state->spec.grad_sync;
  manifest.activation_checkpointing = state->spec.activation_checkpointing;
  manifest.seed = state->spec.seed;
  // An adapter's checkpoint holds the adapter: its base is shared and
  // frozen, and comes back from base_checkpoint.
  manifest.trainable_only =
      options.trainable_only || state->spec.lora.enabled();
  manifest.lora = state->spec.lora;
  manifest.base_checkpoint = state->spec.init_checkpoint;
  manifest.unsaved_window = pending;
  uint64_t bytes = 0;
  TALLY_RETURN_IF_ERROR(consolidation().WriteOnRankZero(
      {*state->model, *state->optimizer, state->spec.frozen},
      {/*with_optimizer_state=*/true, manifest.trainable_only},
      [&](const CausalLm& model, const Optimizer& optimizer) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(bytes,
                               WriteCheckpoint(path, model, optimizer, manifest,
                                               options.server_state));
        return absl::OkStatus();
      }));
  return SaveResult{path, state->step, bytes, pending};
}

absl::StatusOr<LoadResult> Engine::LoadCheckpoint(const std::string& model_id,
                                                  const std::string& path,
                                                  bool load_optimizer) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  // Phase 1, which changes nothing: read, keep the local shards, stage the
  // optimizer and check the weights. A file one rank cannot read fails on
  // that rank only, so the ranks agree before any of them loads.
  CheckpointContents contents;
  auto optimizer = std::make_unique<Optimizer>(state->spec.optimizer,
                                               &state->model->parameters());
  absl::Status staged = [&]() -> absl::Status {
    TALLY_RETURN_IF_ERROR(InjectedFault(FaultPoint::kLoad));
    TALLY_ASSIGN_OR_RETURN(contents, ReadCheckpoint(path, load_optimizer,
                                                    &state->model->config()));
    TALLY_RETURN_IF_ERROR(
        CheckAdapterCheckpoint(contents, state->model->lora(), path));
    if (Staged(*state->model, groups_)) {
      TALLY_RETURN_IF_ERROR(
          KeepLocalShards(*state->model, groups_.pp->size() > 1, contents));
    }
    if (load_optimizer) {
      if (!contents.manifest) {
        return absl::FailedPreconditionError(absl::StrCat(
            path,
            " holds no optimizer state (not a tally checkpoint); use "
            "load_optimizer = false"));
      }
      if (contents.manifest->optimizer != state->spec.optimizer) {
        return absl::FailedPreconditionError(absl::StrCat(
            path, " holds ", OptimizerName(contents.manifest->optimizer),
            " state but model '", model_id, "' uses ",
            OptimizerName(state->spec.optimizer)));
      }
      TALLY_RETURN_IF_ERROR(optimizer->LoadState(
          contents.optimizer_state, contents.manifest->optimizer_step_count));
    }
    return ValidateWeightsFor(contents, *state->model);
  }();
  TALLY_RETURN_IF_ERROR(phases().Agree(staged));
  // Phase 2: apply.
  // A copy may fail on one rank only; the gathers need every rank's shards.
  absl::Status loaded =
      phases().Agree(LoadWeightsInto(contents, *state->model));
  if (loaded.ok()) {
    loaded = RefreshGathered(*state->model, ShardsChanged::kLoaded);
  }
  if (!loaded.ok()) {
    // A copy failed midway: weights are mixed, whatever the window says.
    state->damage = absl::StrCat(
        "LoadCheckpoint failed while copying weights (", loaded.message(), ")");
    return loaded;
  }
  state->damage.clear();
  LoadResult result;
  result.discarded = state->window.counts();
  state->optimizer = std::move(optimizer);
  state->step = contents.manifest ? contents.manifest->step : 0;
  ClearWindow(*state);
  result.model = Summarize(*state);
  result.server_state = std::move(contents.server_state);
  if (contents.manifest)
    result.unsaved_window = contents.manifest->unsaved_window;
  return result;
}

}  // namespace tally
