#include "runtime/engine.h"

#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "runtime/checkpoint.h"
#include "runtime/loss.h"
#include "runtime/status.h"

namespace tally {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                       start)
      .count();
}

absl::Status NotFound(const std::string& model_id) {
  return absl::NotFoundError(absl::StrCat("model '", model_id, "' not found"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    const EngineOptions& options, Mesh mesh,
    std::unique_ptr<Communicator> world) {
  if (!world || world->size() != mesh.world_size() ||
      world->rank() != mesh.rank()) {
    return absl::InvalidArgumentError(
        "the world communicator does not match the mesh");
  }
  if (options.max_batch_tokens < 1) {
    return absl::InvalidArgumentError("max_batch_tokens must be >= 1");
  }
  return std::unique_ptr<Engine>(
      new Engine(options, std::move(mesh), std::move(world)));
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::CreateSingleRank(
    const EngineOptions& options) {
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> world,
                         MakeSingleRankCommunicator());
  return Create(options, Mesh::SingleRank(), std::move(world));
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

absl::StatusOr<LlamaModel*> Engine::model(const std::string& model_id) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  return state->model.get();
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
  return s;
}

absl::StatusOr<ModelSummary> Engine::CreateModel(const ModelSpec& request) {
  ModelSpec spec = request;
  if (spec.model_id.empty()) {
    do {
      spec.model_id = absl::StrCat("model-", next_auto_id_++);
    } while (models_.count(spec.model_id));
  }
  if (models_.count(spec.model_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("model '", spec.model_id, "' already exists"));
  }
  TALLY_RETURN_IF_ERROR(ValidateAdamParams(spec.default_adam, "default_adam"));
  if (!std::isfinite(spec.default_max_grad_norm) ||
      spec.default_max_grad_norm < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("default_max_grad_norm must be finite and >= 0, got ",
                     spec.default_max_grad_norm));
  }
  std::optional<CheckpointContents> init;
  if (!spec.init_checkpoint.empty()) {
    TALLY_ASSIGN_OR_RETURN(init, ReadCheckpoint(spec.init_checkpoint,
                                                /*read_optimizer=*/false));
    const bool config_given = spec.config.vocab_size != 0;
    if (config_given && spec.config.WithDefaults() != init->config) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config differs from the config.json of init_checkpoint ",
          spec.init_checkpoint, "; omit config to use the checkpoint's"));
    }
    spec.config = init->config;
  }
  spec.config = spec.config.WithDefaults();
  TALLY_RETURN_IF_ERROR(spec.config.Validate());

  auto state = std::make_unique<ModelState>();
  TALLY_ASSIGN_OR_RETURN(state->model,
                         LlamaModel::Create(spec.config, spec.dtype, spec.seed));
  if (init) TALLY_RETURN_IF_ERROR(LoadWeightsInto(*init, *state->model));
  state->optimizer = std::make_unique<Optimizer>(
      spec.optimizer, &state->model->parameters());
  state->spec = spec;
  ModelSummary summary = Summarize(*state);
  models_[spec.model_id] = std::move(state);
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
  return summary;
}

absl::StatusOr<ForwardBackwardResult> Engine::ForwardBackward(
    const std::string& model_id, const ForwardBackwardArgs& args) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_RETURN_IF_ERROR(ValidateSamples(state->spec.config, args.samples));
  if (!args.forward_only) {
    TALLY_RETURN_IF_ERROR(state->window.CheckReduction(args.reduction));
  }
  absl::StatusOr<ForwardBackwardResult> result =
      RunForwardBackward(*state, args);
  // Validation passed, so a failure here happened mid-computation, possibly
  // after some micro-batches added their gradients.
  if (!result.ok() && !args.forward_only) state->poisoned = true;
  return result;
}

absl::StatusOr<ForwardBackwardResult> Engine::RunForwardBackward(
    ModelState& state, const ForwardBackwardArgs& args) {
  const auto start = std::chrono::steady_clock::now();
  LlamaModel& model = *state.model;
  ForwardBackwardResult result;
  result.samples.resize(args.samples.size());
  int64_t padded_tokens = 0;
  double sample_mean_sum = 0.0;
  const std::vector<PackedBatch> batches = PackSamples(
      args.samples, model.scalar_type(), options_.max_batch_tokens);
  for (const PackedBatch& batch : batches) {
    TALLY_RETURN_IF_ERROR(CatchTorch("forward_backward", [&] {
      std::optional<torch::NoGradGuard> no_grad;
      if (args.forward_only) no_grad.emplace();
      torch::Tensor logprobs =
          model.TargetLogprobs(batch.inputs, batch.targets, batch.lengths);
      LossTerms terms = ComputeLoss(logprobs, batch, args.reduction);
      if (!args.forward_only) terms.raw_loss.backward();

      auto loss_sums = terms.sample_loss_sums.accessor<double, 1>();
      auto valid = terms.sample_valid_tokens.accessor<int64_t, 1>();
      torch::Tensor row_logprobs;
      if (args.return_logprobs) {
        row_logprobs = logprobs.detach()
                           .masked_fill(~batch.has_target, 0.0)
                           .to(torch::kFloat64)
                           .contiguous();
      }
      for (size_t b = 0; b < batch.sample_index.size(); ++b) {
        SampleResult& out = result.samples[batch.sample_index[b]];
        out.loss_sum = loss_sums[b];
        out.valid_tokens = valid[b];
        result.loss_sum += loss_sums[b];
        if (valid[b] > 0) sample_mean_sum += loss_sums[b] / valid[b];
        if (args.return_logprobs) {
          const double* row = row_logprobs[b].data_ptr<double>();
          out.logprobs.assign(row, row + batch.lengths[b]);
        }
      }
      result.valid_tokens += terms.valid_tokens;
      result.num_samples += terms.counted_samples;
      padded_tokens += batch.inputs.numel();
    }));
  }
  if (args.reduction == LossReduction::kSampleMean) {
    result.loss_mean =
        result.num_samples > 0 ? sample_mean_sum / result.num_samples : 0.0;
  } else {
    result.loss_mean = result.valid_tokens > 0
                           ? result.loss_sum / result.valid_tokens
                           : 0.0;
  }
  if (!args.forward_only) {
    state.window.Add(args.reduction, result.valid_tokens, result.num_samples);
  }
  result.window = state.window.counts();
  result.metrics["micro_batches"] = static_cast<double>(batches.size());
  result.metrics["padded_tokens"] = static_cast<double>(padded_tokens);
  result.metrics["seconds"] = SecondsSince(start);
  return result;
}

void Engine::ClearWindow(ModelState& state) {
  ZeroGradients(state.model->parameters());
  state.window.Clear();
  state.poisoned = false;
}

absl::StatusOr<OptimStepResult> Engine::OptimStep(const std::string& model_id,
                                                  const OptimStepArgs& args) {
  const auto start = std::chrono::steady_clock::now();
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  if (state->poisoned) {
    return absl::AbortedError(
        "the accumulation window is poisoned by a failed ForwardBackward; "
        "call AbortAccumulation and resend the window");
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
  if (!std::isfinite(max_norm) || max_norm < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_grad_norm must be finite and >= 0, got ", max_norm));
  }
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
  TALLY_ASSIGN_OR_RETURN(
      ClipResult clip, NormalizeAndClip(params, normalizer, mesh_, *world_,
                                        args.norm_type, max_norm));
  OptimStepResult result;
  result.grad_norm = clip.norm.total;
  result.clip_coef = clip.clip_coef;
  result.normalizer = normalizer;
  result.learning_rate = hp.learning_rate;
  result.metrics["grad_norm_dense"] = clip.norm.dense;
  result.metrics["grad_norm_expert"] = clip.norm.expert;
  result.metrics["window_calls"] =
      static_cast<double>(state->window.counts().calls);
  if (!std::isfinite(clip.norm.total)) {
    const std::string reason =
        absl::StrCat("non-finite gradient norm (", clip.norm.total, ")");
    if (args.nonfinite == NonFinitePolicy::kError) {
      return absl::FailedPreconditionError(absl::StrCat(
          reason, "; nothing changed and the window is kept (policy ERROR); "
                  "call AbortAccumulation to discard it"));
    }
    ClearWindow(*state);
    result.skipped = true;
    result.skip_reason = reason;
    result.step = state->step;
    result.metrics["seconds"] = SecondsSince(start);
    return result;
  }
  absl::Status stepped = state->optimizer->Step(hp);
  ClearWindow(*state);
  TALLY_RETURN_IF_ERROR(stepped);
  result.step = ++state->step;
  result.metrics["seconds"] = SecondsSince(start);
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
                                                  const std::string& path) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  CheckpointManifest manifest;
  manifest.step = state->step;
  manifest.dtype = state->spec.dtype;
  manifest.optimizer = state->spec.optimizer;
  manifest.optimizer_step_count = state->optimizer->step_count();
  manifest.default_adam = state->spec.default_adam;
  manifest.default_max_grad_norm = state->spec.default_max_grad_norm;
  manifest.tally_version = TALLY_VERSION;
  TALLY_ASSIGN_OR_RETURN(
      uint64_t bytes,
      WriteCheckpoint(path, *state->model, *state->optimizer, manifest));
  return SaveResult{path, state->step, bytes};
}

absl::StatusOr<LoadResult> Engine::LoadCheckpoint(const std::string& model_id,
                                                  const std::string& path,
                                                  bool load_optimizer) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_ASSIGN_OR_RETURN(CheckpointContents contents,
                         ReadCheckpoint(path, load_optimizer));
  // Stage the optimizer first so a bad file changes nothing.
  auto optimizer = std::make_unique<Optimizer>(state->spec.optimizer,
                                               &state->model->parameters());
  if (load_optimizer) {
    if (!contents.manifest) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " holds no optimizer state (not a tally checkpoint); use "
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
  TALLY_RETURN_IF_ERROR(LoadWeightsInto(contents, *state->model));
  LoadResult result;
  result.discarded = state->window.counts();
  state->optimizer = std::move(optimizer);
  state->step = contents.manifest ? contents.manifest->step : 0;
  ClearWindow(*state);
  result.model = Summarize(*state);
  return result;
}

}  // namespace tally
