// Checkpointer: the server's own checkpoints: one every N optimizer steps of
// each model (keeping the newest K), a final one of every model at shutdown
// (`--checkpoint-on-exit`), and `--resume`, which brings every model found in
// the checkpoint directory back at its newest valid checkpoint.
//
// Layout (docs/checkpoints.md): <dir>/<model_id>/step-<12-digit step>/, a
// full checkpoint each; with bearer-token auth a model's engine id is
// "<tenant>/<model_id>", so its directory is <dir>/<tenant>/<model_id>/.
// Every call runs on the executor thread (or before serving starts, or after
// the executor stopped) and runs its commands on every rank through the
// command table (commands.h), like a client request; it records its own
// checkpoint metrics, not the table's.
//
//   tally::Checkpointer checkpointer(options, engine, &engine->control(),
//                                    metrics);
//   TALLY_ASSIGN_OR_RETURN(auto resumed, checkpointer.Resume());
//   checkpointer.AfterOptimStep(model_id, response);  // may save
//   checkpointer.SaveAllOnExit();  // at shutdown, with --checkpoint-on-exit
#ifndef TALLY_SERVER_CHECKPOINTER_H_
#define TALLY_SERVER_CHECKPOINTER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/communicator.h"
#include "server/commands.h"
#include "server/metrics.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

struct CheckpointerOptions {
  std::string dir;
  int64_t every_steps = 0;  // 0: no periodic checkpoints
  int keep = 3;
  // With bearer-token auth every model belongs to a tenant: Resume reads
  // <dir>/<tenant>/<model_id>/ only, and <dir>/<model_id>/ only without.
  bool tenant_dirs = false;
};

struct ResumedModel {
  std::string model_id;  // the engine id
  std::string path;
  int64_t step = 0;
  std::string server_state;  // what the server stored with the checkpoint
};

// A model --resume found and could not restore.
struct UnresumedModel {
  std::string model_id;  // the engine id
  std::string path;      // the checkpoint that failed
  absl::Status error;
};

struct ResumeReport {
  std::vector<ResumedModel> resumed;
  std::vector<UnresumedModel> failed;
};

class Checkpointer {
 public:
  Checkpointer(CheckpointerOptions options, Engine* engine,
               Communicator* control, ServerMetrics* metrics)
      : options_(std::move(options)),
        engine_(engine),
        control_(control),
        commands_(*control, *engine, /*metrics=*/nullptr),
        metrics_(metrics) {}

  // The bytes stored as a checkpoint's server_state (the sequencing state of
  // a model); empty when unset.
  void set_server_state_source(
      std::function<std::string(const std::string& model_id)> source) {
    server_state_source_ = std::move(source);
  }

  // After an OptimStep of `model_id` that returned `response`: saves when an
  // applied step reached a multiple of every_steps, then prunes. A failed save
  // is logged and counted, not returned: the step itself succeeded.
  void AfterOptimStep(const std::string& model_id,
                      const v1::OptimStepResponse& response);

  // Saves every model at its current step, in the layout of the periodic
  // checkpoints (pruned alike). A pending window is not saved: its
  // gradients are dropped, with a warning, and tally.json records it, so
  // Resume poisons the resumed window (see there). Failures are logged and
  // counted, and the other models are still saved.
  void SaveAllOnExit();

  // For each model directory in `dir` (sorted by id; with tenant_dirs the
  // engine id is "<tenant>/<model_id>", so the model stays its tenant's),
  // creates the model if it does not exist and loads its newest checkpoint
  // that passes VerifyCheckpoint, skipping damaged ones (DATA_LOSS) with a
  // warning. A model whose checkpoints are all damaged is skipped. Any other
  // failure (an unreadable directory, a config this server refuses, an
  // allocation) is that model's alone: it is logged, counted as a failed
  // resume, left out (a half-created model is deleted again) and reported in
  // `failed`, and the other models still resume — older checkpoints of it
  // are not tried, so no client silently continues from an older step. A
  // checkpoint that dropped a pending window (an exit checkpoint) comes back
  // with its window poisoned: the client's calls of that window executed
  // (the sequencing state says so) but their gradients are gone, so its next
  // OptimStep must fail ABORTED, not step on a partial window.
  ResumeReport Resume();

  std::string ModelDir(const std::string& model_id) const;

  // After a LoadCheckpoint set `model_id` back to `step`: its periodic
  // checkpoints of later steps belong to the abandoned branch, so they move
  // to <model dir>/abandoned/, out of --resume's and pruning's way (which
  // would otherwise keep them over the new branch's saves). A failure is
  // logged.
  void AfterLoad(const std::string& model_id, int64_t step);

  // After DeleteModel: removes the model's periodic and exit checkpoints,
  // so that --resume does not bring it back. A failure is logged.
  void ForgetModel(const std::string& model_id);

 private:
  absl::Status ResumeModel(const std::string& model_id, const std::string& path,
                           ResumedModel* resumed);
  // Deletes `model_id` on every rank if a failed resume created it.
  void DiscardHalfResumed(const std::string& model_id);
  // Saves `model_id` at `step` into its step directory, then prunes.
  absl::Status SaveStep(const std::string& model_id, int64_t step,
                        bool allow_pending, v1::SaveCheckpointResponse* saved);

  CheckpointerOptions options_;
  Engine* engine_;
  Communicator* control_;
  const CommandRunner commands_;
  ServerMetrics* metrics_;
  std::function<std::string(const std::string&)> server_state_source_;
};

}  // namespace tally

#endif  // TALLY_SERVER_CHECKPOINTER_H_
