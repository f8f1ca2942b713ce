// Checkpoint: the on-disk form of a tally model, an HF Llama directory plus
// tally's own state, so `transformers` loads a tally checkpoint unchanged and
// tally starts from any HF Llama directory.
//
//   <dir>/config.json              LlamaConfig::ToHfJson
//   <dir>/model.safetensors        every parameter under its HF name
//   <dir>/optimizer.safetensors    Optimizer::StateTensors() (empty for SGD)
//   <dir>/tally.json               CheckpointManifest
//
//   CheckpointManifest manifest;
//   manifest.step = step;
//   TALLY_ASSIGN_OR_RETURN(uint64_t bytes,
//                          WriteCheckpoint(dir, *model, optimizer, manifest));
//   TALLY_ASSIGN_OR_RETURN(CheckpointContents contents,
//                          ReadCheckpoint(dir, /*read_optimizer=*/true));
//   TALLY_RETURN_IF_ERROR(LoadWeightsInto(contents, *model));
//   TALLY_RETURN_IF_ERROR(optimizer.LoadState(
//       contents.optimizer_state, contents.manifest->optimizer_step_count));
#ifndef TALLY_RUNTIME_CHECKPOINT_H_
#define TALLY_RUNTIME_CHECKPOINT_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/llama_config.h"
#include "runtime/llama_model.h"
#include "runtime/optimizer.h"
#include "runtime/safetensors.h"
#include "runtime/types.h"

namespace tally {

// tally.json: what an HF directory does not record.
struct CheckpointManifest {
  int64_t step = 0;  // model step (optimizer updates applied)
  DType dtype = DType::kFloat32;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  int64_t optimizer_step_count = 0;  // AdamW bias-correction step
  AdamParams default_adam;
  double default_max_grad_norm = 0.0;
  std::string tally_version;  // of the writer
  int format_version = 1;
};

// The format_version this build writes and the newest it reads.
inline constexpr int kCheckpointFormatVersion = 1;

// Writes the four files of a checkpoint into `dir`, creating it (and its
// parents) when missing; each file is replaced atomically. A tied model has
// no lm_head.weight, as in HF. The caller supplies the manifest's step and
// defaults; dtype, optimizer and optimizer_step_count are recorded from
// `model` and `optimizer`, tally_version and format_version from this build,
// so the manifest cannot contradict the tensors. Returns the bytes written.
absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& dir,
                                         const LlamaModel& model,
                                         const Optimizer& optimizer,
                                         const CheckpointManifest& manifest);

struct CheckpointContents {
  LlamaConfig config;
  std::optional<CheckpointManifest> manifest;  // absent for an HF directory
  NamedTensors weights;                        // HF names
  NamedTensors optimizer_state;  // empty unless read_optimizer and present
};

// Reads a tally checkpoint or an HF Llama directory (config.json plus
// model.safetensors or a sharded model.safetensors.index.json). A missing
// `dir` is NOT_FOUND; a missing or invalid config.json, or no weights file,
// INVALID_ARGUMENT naming the file; corrupt files DATA_LOSS.
absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& dir,
                                                  bool read_optimizer);

// Copies `contents.weights` into the parameters of `model` by name, cast to
// the model dtype, all or nothing. FAILED_PRECONDITION naming the first
// config field that differs from model.config(); INVALID_ARGUMENT naming the
// tensor for a missing, misshaped or unknown weight. A tied model ignores an
// lm_head.weight in the file, as HF does.
absl::Status LoadWeightsInto(const CheckpointContents& contents,
                             LlamaModel& model);

// The checks of LoadWeightsInto without the copy: OK exactly when
// LoadWeightsInto(contents, model) would succeed. Lets several ranks agree
// before any of them changes its model.
absl::Status ValidateWeightsFor(const CheckpointContents& contents,
                                LlamaModel& model);

}  // namespace tally

#endif  // TALLY_RUNTIME_CHECKPOINT_H_
