#include "runtime/engine/engine.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/error_reason.h"
#include "base/status.h"
#include "runtime/checkpoint/directory_identity.h"
#include "runtime/config/generation_config.h"
#include "runtime/engine/forward_backward.h"
#include "runtime/parallel/device.h"
#include "runtime/parallel/fault_hook.h"
#include "runtime/train/loss.h"
#include "runtime/train/loss_registry.h"
#include "runtime/train/step_guard.h"
#include "runtime/train/token_loss.h"

namespace tally {
namespace {

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
  TALLY_ASSIGN_OR_RETURN(engine->groups_, FormEngineGroups(*groups));
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
  engine->groups_ = SingleRankGroups(*engine->single_rank_world_);
  engine->control_ = engine->single_rank_world_.get();
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

absl::StatusOr<const CausalLm*> Engine::model(
    const std::string& model_id) const {
  TALLY_ASSIGN_OR_RETURN(const ModelState* state, Find(model_id));
  return &state->built->model();
}

ModelSummary Engine::Summarize(const ModelState& state) {
  ModelSummary s = state.built->Describe();
  s.step = state.step;
  s.window = state.window.counts();
  s.damage = state.damage;
  s.eos_token_ids = state.eos_token_ids;
  return s;
}

RankPhases Engine::phases() const {
  return RankPhases(process_groups_.get(), *groups_.world);
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
  BuildOptions build;
  build.device = options_.device;
  build.attention = options_.attention;
  build.zero_stage = options_.zero_stage;
  build.bucket_bytes = options_.bucket_mb << 20;
  // Building can fail on one rank only (an unreadable init_checkpoint, memory):
  // the ranks agree before any of them adds the model.
  // The EOS tokens of init_checkpoint (a Sample's default stop) first: a
  // malformed generation config refuses the model before it is built.
  absl::StatusOr<std::vector<int64_t>> eos =
      ReadEosTokenIds(spec.init_checkpoint);
  using Built = absl::StatusOr<std::unique_ptr<BuiltModel>>;
  Built built = eos.ok() ? BuildModel(spec, base_key,
                                      RankContext{mesh_, groups_, phases()},
                                      build, bases_)
                         : Built(eos.status());
  TALLY_RETURN_IF_ERROR(phases().Agree(built.status()));
  auto state = std::make_unique<ModelState>();
  state->built = *std::move(built);
  state->eos_token_ids = *std::move(eos);
  // Finished only now: a rank that failed to build would never reach its
  // collectives.
  TALLY_RETURN_IF_ERROR(state->built->FinishBuild());
  bases_.Remember(base_key, state->built->model());
  ModelSummary summary = Summarize(*state);
  models_[summary.model_id] = std::move(state);
  return summary;
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
  // The last model sharing a base took it along.
  bases_.ForgetUnshared();
  return summary;
}

absl::StatusOr<ForwardBackwardResult> Engine::ForwardBackward(
    const std::string& model_id, const ForwardBackwardArgs& args) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_RETURN_IF_ERROR(CheckIntact(*state));
  TALLY_RETURN_IF_ERROR(ValidateSamples(state->spec().config, args.samples));
  TALLY_ASSIGN_OR_RETURN(const std::shared_ptr<const TokenLoss> loss,
                         MakeTokenLoss(args.loss));
  TALLY_RETURN_IF_ERROR(ValidateLossInputs(*loss, args.samples));
  TALLY_RETURN_IF_ERROR(CheckAuxiliaryLossesApply(state->built->model(), args));
  if (!args.forward_only) {
    TALLY_RETURN_IF_ERROR(state->window.CheckReduction(args.reduction));
  }
  PassOptions pass;
  pass.device = options_.device;
  pass.max_batch_tokens = options_.max_batch_tokens;
  pass.pp_microbatches = options_.pp_microbatches;
  pass.overlap_grad_sync = options_.overlap_grad_sync;
  // EAGER, or a DEFERRED window already summed: the call sums its own.
  pass.sum_call_gradients =
      state->spec().grad_sync == GradSync::kEager || state->replicas_summed;
  absl::StatusOr<ForwardBackwardResult> result =
      RunForwardBackwardPass(*state->built, args, *loss, pass);
  if (result.ok()) {
    if (!args.forward_only) {
      state->window.Add(args.reduction, result->valid_tokens,
                        result->num_samples);
    }
    result->window = state->window.counts();
  }
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

void Engine::ClearWindow(ModelState& state) {
  state.built->ClearGradients();
  state.window.Clear();
  state.poisoned = false;
  state.poison_reason.clear();
  state.replicas_summed = false;
}

absl::Status Engine::CheckIntact(const ModelState& state) {
  if (state.damage.empty()) return absl::OkStatus();
  return ReasonError(
      ErrorReason::kModelDamaged,
      absl::StrCat("model '", state.spec().model_id,
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

absl::StatusOr<Engine::StepSettings> Engine::CheckStep(
    const ModelState& state, const OptimStepArgs& args) {
  TALLY_RETURN_IF_ERROR(CheckIntact(state));
  if (state.poisoned) {
    return ReasonError(
        ErrorReason::kWindowPoisoned,
        absl::StrCat("the accumulation window is poisoned (",
                     state.poison_reason,
                     "); call AbortAccumulation and resend the window"));
  }
  const ModelSpec& spec = state.spec();
  if (spec.optimizer == OptimizerKind::kSgd &&
      (args.adam.beta1 || args.adam.beta2 || args.adam.eps)) {
    return absl::InvalidArgumentError(
        "adam.beta1, adam.beta2 and adam.eps do not apply to an SGD model");
  }
  StepSettings settings;
  settings.hp = args.adam.ResolveAgainst(spec.default_adam);
  TALLY_RETURN_IF_ERROR(ValidateAdamParams(settings.hp, "adam"));
  settings.max_norm = args.max_grad_norm.value_or(spec.default_max_grad_norm);
  TALLY_RETURN_IF_ERROR(
      ValidateMaxGradNorm(settings.max_norm, "max_grad_norm"));
  if (state.window.empty()) {
    return absl::FailedPreconditionError(
        "nothing accumulated: call ForwardBackward before OptimStep");
  }
  settings.normalizer = state.window.Normalizer();
  if (settings.normalizer == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the window of ", state.window.counts().calls,
        " calls has no valid token; refusing to step on zero gradients "
        "(call AbortAccumulation or add data)"));
  }
  return settings;
}

absl::Status Engine::SumWindow(ModelState& state) {
  if (state.spec().grad_sync != GradSync::kDeferred || state.replicas_summed) {
    return absl::OkStatus();
  }
  // Every rank ends the phase, as it agrees over the world: a middle
  // pipeline stage may have nothing to sum while the others sum.
  absl::Status summed =
      phases().Finish(state.built->gradient_sync().SumAccumulated());
  // A partial sum cannot be undone: the window is no longer trustworthy.
  if (!summed.ok()) {
    const bool poisoned =
        Poison(state, absl::StrCat("summing the window over replicas failed: ",
                                   summed.message()));
    return poisoned ? MarkPoisonedTheWindow(summed) : summed;
  }
  state.replicas_summed = true;
  return absl::OkStatus();
}

absl::StatusOr<OptimStepResult> Engine::OptimStep(const std::string& model_id,
                                                  const OptimStepArgs& args) {
  const absl::Time start = absl::Now();
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_ASSIGN_OR_RETURN(const StepSettings settings, CheckStep(*state, args));
  TALLY_RETURN_IF_ERROR(SumWindow(*state));
  BuiltModel& built = *state->built;
  absl::Status norm_ready = InjectedFault(FaultPoint::kGradNorm);
  absl::StatusOr<ClipResult> clipped =
      norm_ready.ok()
          ? ComputeClip(built.model().parameters(), settings.normalizer, mesh_,
                        *groups_.world, args.norm_type, settings.max_norm)
          : norm_ready;
  // Nothing changed yet: a failure keeps the window.
  TALLY_RETURN_IF_ERROR(phases().Finish(clipped.status()));
  const ClipResult& clip = *clipped;
  OptimStepResult result;
  result.grad_norm = clip.norm.total;
  result.clip_coef = clip.clip_coef;
  result.normalizer = settings.normalizer;
  result.learning_rate = settings.hp.learning_rate;
  result.metrics["grad_norm_dense"] = clip.norm.dense;
  result.metrics["grad_norm_expert"] = clip.norm.expert;
  result.metrics["window_calls"] =
      static_cast<double>(state->window.counts().calls);
  // This rank's share of the training state (1/S of it under dp_shard = S).
  const RankStateBytes bytes = built.StateBytes();
  result.metrics["rank_param_bytes"] = bytes.parameters;
  result.metrics["rank_grad_bytes"] = bytes.gradients;
  result.metrics["rank_optimizer_bytes"] = bytes.optimizer;
  // Decided from the agreed norm: the same verdict on every rank.
  if (const std::optional<std::string> reason = UnsafeStepReason(
          clip, settings.hp, state->spec().optimizer, state->spec().dtype)) {
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
  const absl::Status stepped = built.Step(settings.hp, clip.grad_scale);
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
  manifest.unsaved_window = pending;
  TALLY_ASSIGN_OR_RETURN(
      const uint64_t bytes,
      state->built->SaveCheckpoint(path, std::move(manifest), options));
  return SaveResult{path, state->step, bytes, pending};
}

absl::StatusOr<LoadResult> Engine::LoadCheckpoint(const std::string& model_id,
                                                  const std::string& path,
                                                  bool load_optimizer) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  // Phase 1, which changes nothing. A file one rank cannot read fails on
  // that rank only, so the ranks agree before any of them loads.
  absl::StatusOr<StagedLoad> staged =
      state->built->StageLoad(path, load_optimizer);
  TALLY_RETURN_IF_ERROR(phases().Agree(staged.status()));
  // Phase 2: apply.
  if (absl::Status loaded = state->built->ApplyLoad(*staged); !loaded.ok()) {
    // A copy failed midway: weights are mixed, whatever the window says.
    state->damage = absl::StrCat(
        "LoadCheckpoint failed while copying weights (", loaded.message(), ")");
    return loaded;
  }
  const CheckpointContents& contents = staged->contents;
  state->damage.clear();
  LoadResult result;
  result.discarded = state->window.counts();
  state->step = contents.manifest ? contents.manifest->step : 0;
  ClearWindow(*state);
  result.model = Summarize(*state);
  result.server_state = std::move(staged->contents.server_state);
  if (contents.manifest) {
    result.unsaved_window = contents.manifest->unsaved_window;
  }
  return result;
}

}  // namespace tally
