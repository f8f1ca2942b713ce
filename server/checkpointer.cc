#include "server/checkpointer.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/log.h"
#include "base/status.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/directory_identity.h"
#include "server/adapter_state.h"
#include "server/checkpoint_retention.h"
#include "server/commands.h"
#include "server/convert.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

// Subdirectories of `dir` that are valid model ids, sorted.
std::vector<std::string> ModelIdsIn(const fs::path& dir) {
  std::vector<std::string> ids;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (it->is_directory() && ValidateModelId(name).ok()) ids.push_back(name);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace

std::string Checkpointer::ModelDir(const std::string& model_id) const {
  return (fs::path(options_.dir) / model_id).string();
}

void Checkpointer::AfterLoad(const std::string& model_id, int64_t step) {
  const std::string model_dir = ModelDir(model_id);
  // Step directory names are zero-padded: later steps sort after.
  const std::string loaded =
      fs::path(StepCheckpointDir(model_dir, step)).filename().string();
  for (const std::string& dir : ListStepCheckpoints(model_dir)) {
    const std::string name = fs::path(dir).filename().string();
    if (name <= loaded) continue;
    const fs::path abandoned = fs::path(model_dir) / "abandoned" / name;
    std::error_code error;
    fs::create_directories(abandoned.parent_path(), error);
    fs::remove_all(abandoned, error);
    fs::rename(dir, abandoned, error);
    if (error) {
      Log(LogLevel::kWarning,
          absl::StrCat("could not set aside ", dir, " after '", model_id,
                       "' was loaded at step ", step, ": ", error.message(),
                       "; --resume may pick it"));
    }
  }
}

void Checkpointer::ForgetModel(const std::string& model_id) {
  std::error_code error;
  fs::remove_all(ModelDir(model_id), error);
  if (error) {
    Log(LogLevel::kWarning,
        absl::StrCat("could not remove the checkpoints of deleted model '",
                     model_id, "' in ", ModelDir(model_id), ": ",
                     error.message(), "; --resume would bring it back"));
  }
}

absl::Status Checkpointer::SaveStep(const std::string& model_id, int64_t step,
                                    bool allow_pending,
                                    v1::SaveCheckpointResponse* saved) {
  v1::SaveCheckpointRequest request;
  request.set_model_id(model_id);
  request.set_path(StepCheckpointDir(ModelDir(model_id), step));
  request.set_allow_pending(allow_pending);
  RankZeroData rank_zero;
  if (server_state_source_) {
    rank_zero.server_state = server_state_source_(model_id);
  }
  TALLY_RETURN_IF_ERROR(
      commands_.Run(kSaveCheckpointCommand, request, saved, rank_zero));
  return PruneStepCheckpoints(ModelDir(model_id), options_.keep);
}

void Checkpointer::AfterOptimStep(const std::string& model_id,
                                  const v1::OptimStepResponse& response) {
  if (options_.every_steps <= 0 || response.skipped() ||
      response.step() % options_.every_steps != 0) {
    return;
  }
  const absl::Time start = absl::Now();
  v1::SaveCheckpointResponse saved;
  const absl::Status status =
      SaveStep(model_id, response.step(), /*allow_pending=*/false, &saved);
  metrics_->RecordCheckpoint("periodic", status.ok(),
                             absl::ToDoubleSeconds(absl::Now() - start));
  if (!status.ok()) {
    Log(LogLevel::kWarning,
        absl::StrCat("periodic checkpoint of model '", model_id, "' at step ",
                     response.step(), " failed: ", status.ToString()));
  }
}

void Checkpointer::SaveAllOnExit() {
  for (const ModelSummary& model : engine_->ListModels()) {
    const absl::Time start = absl::Now();
    v1::SaveCheckpointResponse saved;
    // The steps taken are worth keeping even when a window is pending; its
    // gradients could not be resumed anyway.
    const absl::Status status =
        SaveStep(model.model_id, model.step, /*allow_pending=*/true, &saved);
    metrics_->RecordCheckpoint("exit", status.ok(),
                               absl::ToDoubleSeconds(absl::Now() - start));
    if (!status.ok()) {
      Log(LogLevel::kError,
          absl::StrCat("exit checkpoint of model '", model.model_id,
                       "' at step ", model.step,
                       " failed: ", status.ToString()));
      continue;
    }
    Log(LogLevel::kInfo,
        absl::StrCat("exit checkpoint of model '", model.model_id, "' at step ",
                     saved.step(), ": ", saved.path()));
    if (saved.unsaved_calls() > 0) {
      Log(LogLevel::kWarning,
          absl::StrCat("exit checkpoint of model '", model.model_id,
                       "' drops its pending window (", saved.unsaved_calls(),
                       " calls, ", saved.unsaved_tokens(),
                       " tokens); resumed, the window is poisoned"));
    }
  }
}

ResumeReport Checkpointer::Resume() {
  ResumeReport report;
  // <dir>/<model>/step-N, or <dir>/<tenant>/<model>/step-N. Which one is the
  // server's setting, not a guess from the contents: a tenant's model named
  // like a step directory must not turn its tenant into a model.
  std::vector<std::string> model_ids = ModelIdsIn(options_.dir);
  if (options_.tenant_dirs) {
    std::vector<std::string> tenants = std::move(model_ids);
    model_ids.clear();
    for (const std::string& tenant : tenants) {
      for (const std::string& model : ModelIdsIn(ModelDir(tenant))) {
        model_ids.push_back(ScopedModelId(tenant, model));
      }
    }
  }
  for (const std::string& model_id : model_ids) {
    bool done = false;
    for (const std::string& path : ListStepCheckpoints(ModelDir(model_id))) {
      const absl::Time start = absl::Now();
      ResumedModel model;
      const absl::Status status = ResumeModel(model_id, path, &model);
      metrics_->RecordCheckpoint("resume", status.ok(),
                                 absl::ToDoubleSeconds(absl::Now() - start));
      if (absl::IsDataLoss(status)) {
        Log(LogLevel::kWarning, absl::StrCat("skipping damaged checkpoint ",
                                             path, ": ", status.message()));
        continue;
      }
      done = true;
      if (!status.ok()) {
        Log(LogLevel::kError,
            absl::StrCat("model '", model_id, "' not resumed from ", path, ": ",
                         status.ToString()));
        DiscardHalfResumed(model_id);
        report.failed.push_back({model_id, path, status});
        break;
      }
      Log(LogLevel::kInfo,
          absl::StrCat("resumed model '", model_id, "' at step ", model.step,
                       " from ", path));
      report.resumed.push_back(std::move(model));
      break;
    }
    if (!done) {
      Log(LogLevel::kWarning,
          absl::StrCat("no valid checkpoint for model '", model_id, "' in ",
                       ModelDir(model_id), "; not resumed"));
    }
  }
  return report;
}

void Checkpointer::DiscardHalfResumed(const std::string& model_id) {
  if (!engine_->GetModel(model_id).ok()) return;
  v1::DeleteModelRequest request;
  request.set_model_id(model_id);
  v1::DeleteModelResponse deleted;
  const absl::Status status =
      commands_.Run(kDeleteModelCommand, request, &deleted);
  if (!status.ok()) {
    Log(LogLevel::kError, absl::StrCat("deleting the half-resumed model '",
                                       model_id, "': ", status.ToString()));
  }
}

absl::Status Checkpointer::ResumeModel(const std::string& model_id,
                                       const std::string& path,
                                       ResumedModel* resumed) {
  // Verified first, so a damaged newest checkpoint falls back to an older
  // one before anything is created.
  TALLY_ASSIGN_OR_RETURN(CheckpointInfo info, VerifyCheckpoint(path));
  if (!engine_->GetModel(model_id).ok()) {
    const CheckpointManifest& m = info.manifest;
    v1::CreateModelRequest create;
    create.set_model_id(model_id);
    create.set_seed(m.seed);
    create.set_dtype(ToProto(m.dtype));
    create.set_optimizer(m.optimizer == OptimizerKind::kSgd
                             ? v1::OPTIMIZER_SGD
                             : v1::OPTIMIZER_ADAMW);
    v1::AdamParams* adam = create.mutable_default_adam();
    adam->set_learning_rate(m.default_adam.learning_rate);
    if (m.optimizer == OptimizerKind::kAdamW) {
      adam->set_beta1(m.default_adam.beta1);
      adam->set_beta2(m.default_adam.beta2);
      adam->set_eps(m.default_adam.eps);
    }
    adam->set_weight_decay(m.default_adam.weight_decay);
    create.set_default_max_grad_norm(m.default_max_grad_norm);
    create.set_grad_sync(m.grad_sync == GradSync::kDeferred
                             ? v1::GRAD_SYNC_DEFERRED
                             : v1::GRAD_SYNC_EAGER);
    create.set_activation_checkpointing(m.activation_checkpointing);
    if (m.lora.enabled()) {
      // An adapter's checkpoint holds the adapter only: its base comes back
      // from where it came from, the adapter by the load below.
      TALLY_RETURN_IF_ERROR(CheckAdapterBase(m, path, m.base_checkpoint));
      AdapterOverItsBase(m, info.config, path, create);
      create.mutable_lora()->clear_init_adapter();
    } else {
      create.set_init_checkpoint(path);
    }
    v1::ModelInfo created;
    TALLY_RETURN_IF_ERROR(commands_.Run(kCreateModelCommand, create, &created));
  }
  v1::LoadCheckpointRequest load;
  load.set_model_id(model_id);
  load.set_path(path);
  load.set_load_optimizer(true);
  v1::LoadCheckpointResponse response;
  LoadResult loaded;
  RankZeroData rank_zero;
  rank_zero.loaded = &loaded;
  TALLY_RETURN_IF_ERROR(
      commands_.Run(kLoadCheckpointCommand, load, &response, rank_zero));
  resumed->server_state = std::move(loaded.server_state);
  TALLY_RETURN_IF_ERROR(PoisonDroppedWindow(*control_, *engine_, model_id,
                                            loaded.unsaved_window,
                                            "the server restarted from"));
  resumed->model_id = model_id;
  resumed->path = path;
  resumed->step = response.model().step();
  return absl::OkStatus();
}

}  // namespace tally
