// Checkpoint: the on-disk form of a tally model, an HF Llama directory plus
// tally's own state, so `transformers` loads a tally checkpoint unchanged and
// tally starts from any HF Llama directory.
//
//   <dir>/config.json              LlamaConfig::ToHfJson
//   <dir>/model.safetensors        every parameter under its HF name
//   <dir>/optimizer.safetensors    Optimizer::StateTensors() (empty for SGD)
//   <dir>/server_state.bin         opaque bytes of the server (may be empty)
//   <dir>/tally.json               CheckpointManifest
//   <dir>/checksums.sha256         `sha256sum` lines for every file above
//
// A checkpoint is published as a whole (atomic_directory.h), so a crash never
// leaves a partial checkpoint under `dir`; docs/checkpoints.md lists the crash
// windows. Reads verify every checksum (DATA_LOSS naming the file). Where
// periodic checkpoints go and how many are kept is the server's
// (server/checkpoint_retention.h).
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
#ifndef TALLY_RUNTIME_CHECKPOINT_CHECKPOINT_H_
#define TALLY_RUNTIME_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/checkpoint/checkpoint_manifest.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/types.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/causal_lm.h"
#include "runtime/train/optimizer.h"

namespace tally {

// The files of an HF model directory that tally writes (checkpoints and
// weights exports, weights_export.h) and reads.
inline constexpr char kConfigFile[] = "config.json";
inline constexpr char kModelFile[] = "model.safetensors";
inline constexpr char kShardIndexFile[] = "model.safetensors.index.json";
inline constexpr char kChecksumFile[] = "checksums.sha256";

// What tally publishes at a path (atomic_directory.h), which decides what the
// publish may replace there: only a directory of the same kind.
enum class DirectoryKind {
  kCheckpoint,     // WriteCheckpoint: holds tally.json
  kWeightsExport,  // WriteWeightsExport: holds checksums.sha256, no tally.json
};

// The absolute, normalized directory `dir` names, when a directory of `kind`
// may be published there: nothing is at `dir`, an empty directory, or a
// directory of the same kind (publishing replaces it, deleting what it held).
// INVALID_ARGUMENT when `dir` names no directory ("/"); anything else
// at `dir` (a file, another directory) is FAILED_PRECONDITION and left alone.
absl::StatusOr<std::string> PublishTarget(const std::string& dir,
                                          DirectoryKind kind);

// The weights of `model` under their HF names (CausalLm::ToHfTensors), cast
// to `dtype` with torch's rounding (round to nearest even); with
// `trainable_only` only the trainable parameters'. What checkpoints and
// weights exports write.
absl::StatusOr<NamedTensors> HfWeights(const CausalLm& model,
                                       torch::ScalarType dtype,
                                       bool trainable_only);

// Writes a checkpoint of `model` and `optimizer` to `dir`, replacing an
// existing checkpoint there atomically; the parent directories are created
// when missing. Anything else at `dir` (a file, a directory without
// tally.json that is not empty) is FAILED_PRECONDITION and left alone
// (PublishTarget). A tied
// model has no lm_head.weight, as in HF. The caller supplies the manifest's
// step, defaults, seed, grad_sync and unsaved_window; dtype, optimizer and
// optimizer_step_count are recorded from `model` and `optimizer`, tally_version
// and format_version from this build, so the manifest cannot contradict the
// tensors. `server_state` is stored as it is. With manifest.trainable_only
// only the trainable parameters' weights are written (a frozen base stays
// where it came from). On failure `dir` is as it was.
// Returns the bytes written.
absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& dir,
                                         const CausalLm& model,
                                         const Optimizer& optimizer,
                                         const CheckpointManifest& manifest,
                                         absl::string_view server_state = {});

struct CheckpointContents {
  LlamaConfig config;
  std::optional<CheckpointManifest> manifest;  // absent for an HF directory
  // HF names (CausalLm::FromHfTensors maps them to the model's parameters).
  NamedTensors weights;
  NamedTensors optimizer_state;  // empty unless read_optimizer and present
  std::string server_state;      // empty when the checkpoint holds none
};

// Reads a tally checkpoint or an HF directory of a supported family
// (config.json plus model.safetensors or a sharded
// model.safetensors.index.json). Every file read is first checked against
// checksums.sha256: a mismatch (a corrupt or truncated file), a listed file
// that is missing or a read file the list does not cover is DATA_LOSS naming
// the file; so is a format-2 tally checkpoint without the list. HF directories
// and format-1 checkpoints have no list and are read unchecked. A missing `dir`
// is NOT_FOUND; a missing or invalid config.json, or no weights file,
// INVALID_ARGUMENT naming the file. Every tensor's name, shape and dtype is
// checked against the model config.json (and tally.json's lora) describes
// before memory for it is allocated (ExpectedTensors): a weight or optimizer
// state of another shape, or a weight the model has no parameter for, is
// INVALID_ARGUMENT naming the file, the tensor and the expected shape. JSON
// files are read through base/json_reader.h: an oversized or too deeply nested
// one is refused naming it (INVALID_ARGUMENT for config.json, DATA_LOSS for
// tally.json and the shard index). With `model_config` (a load into an existing
// model), the tensors are checked against the model that config describes
// instead, so a directory whose config.json describes a larger model allocates
// no more than the model being loaded (its config.json must then match the
// model's, which the load checks before it copies anything).
absl::StatusOr<CheckpointContents> ReadCheckpoint(
    const std::string& dir, bool read_optimizer,
    const LlamaConfig* model_config = nullptr);

// The config.json at `path` (LlamaConfig::FromHfJson), read up to
// kConfigJsonLimits' size: INVALID_ARGUMENT naming the file when it is
// missing, too large, or not a config tally loads.
absl::StatusOr<LlamaConfig> ReadHfConfig(const std::string& path);

// The tally.json of the tally checkpoint `dir`, read alone (unverified: the
// read of the checkpoint that follows checks it against checksums.sha256);
// nullopt for a directory without one (an HF directory). DATA_LOSS naming
// the file as ReadCheckpoint.
absl::StatusOr<std::optional<CheckpointManifest>> ReadManifestIfAny(
    const std::string& dir);

// The config and manifest of a tally checkpoint after verifying the checksum
// of every file in it, without reading the tensors: what `--resume` checks
// before trusting a checkpoint. DATA_LOSS as ReadCheckpoint; a directory
// without tally.json and checksums.sha256 is FAILED_PRECONDITION.
struct CheckpointInfo {
  LlamaConfig config;
  CheckpointManifest manifest;
};
absl::StatusOr<CheckpointInfo> VerifyCheckpoint(const std::string& dir);

// Copies `contents.weights` into the parameters of `model` by name, cast to
// the model dtype, all or nothing. FAILED_PRECONDITION naming the first
// config field that differs from model.config(); INVALID_ARGUMENT naming the
// tensor for a missing, misshaped or unknown weight. A tied model ignores an
// lm_head.weight in the file, as HF does. A trainable-only checkpoint may
// miss frozen parameters, which keep their values.
absl::Status LoadWeightsInto(const CheckpointContents& contents,
                             CausalLm& model);

// The checks of LoadWeightsInto without the copy: OK exactly when
// LoadWeightsInto(contents, model) would succeed. Lets several ranks agree
// before any of them changes its model.
absl::Status ValidateWeightsFor(const CheckpointContents& contents,
                                CausalLm& model);

// Every stage WriteCheckpoint's publishing reports to PublishTestHooks
// (atomic_directory.h), in order. "moved previous aside" only occurs without
// RENAME_EXCHANGE, "exchanged" only with it.
inline constexpr const char* kCheckpointWriteStages[] = {
    "created staging directory",
    "wrote config.json",
    "wrote model.safetensors",
    "wrote optimizer.safetensors",
    "wrote server_state.bin",
    "wrote tally.json",
    "wrote checksums.sha256",
    "synced staging directory",
    "moved previous aside",
    "exchanged",
    "published",
    "removed previous"};

}  // namespace tally

#endif  // TALLY_RUNTIME_CHECKPOINT_CHECKPOINT_H_
