// CheckpointManifest: tally.json, what a tally checkpoint records beyond an
// HF directory (runtime/checkpoint/checkpoint.h), and its JSON form.
// Torch-free, so the parser of this untrusted file is fuzzed on its own
// (tests/fuzz/checkpoint_manifest_fuzzer.cc).
//
//   const std::string text = tally::ManifestToJson(manifest);
//   TALLY_ASSIGN_OR_RETURN(tally::CheckpointManifest read,
//                          tally::ParseCheckpointManifest(text, path));
#ifndef TALLY_RUNTIME_CHECKPOINT_CHECKPOINT_MANIFEST_H_
#define TALLY_RUNTIME_CHECKPOINT_CHECKPOINT_MANIFEST_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/config/lora_config.h"
#include "runtime/config/types.h"

namespace tally {

// tally.json: what an HF directory does not record.
struct CheckpointManifest {
  int64_t step = 0;  // model step (optimizer updates applied)
  DType dtype = DType::kFloat32;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  int64_t optimizer_step_count = 0;  // AdamW bias-correction step
  AdamParams default_adam;
  double default_max_grad_norm = 0.0;
  GradSync grad_sync = GradSync::kEager;
  // The model's initialization seed. Training draws no random numbers after
  // initialization, so the seed is the model's whole RNG state.
  uint64_t seed = 0;
  // The accumulation window that was pending at save time and is not in the
  // checkpoint (its gradients are never saved); calls = 0 when none was.
  WindowCounts unsaved_window;
  // Holds the weights (and optimizer state) of the trainable parameters
  // only: loading it leaves the frozen ones as they are.
  bool trainable_only = false;
  // The model's activation checkpointing setting (a --resume re-creates the
  // model with it); absent in older checkpoints: off.
  bool activation_checkpointing = false;
  // A LoRA adapter's checkpoint (rank > 0; trainable_only): the adapter's
  // config, and the init_checkpoint its base came from (empty: drawn from
  // config.json and seed) with that directory's DirectoryIdentity
  // (runtime/checkpoint/directory_identity.h) when the model was created,
  // which a resume from the checkpoint's path alone checks (empty in older
  // checkpoints: not checked).
  LoraConfig lora;
  std::string base_checkpoint;
  std::string base_identity;
  std::string tally_version;  // of the writer
  int format_version = 2;
};

// The format_version this build writes and the newest it reads. Version 1
// (no checksums, server state or seed) is still read.
inline constexpr int kCheckpointFormatVersion = 2;

// tally.json's text: indented JSON ending in a newline.
std::string ManifestToJson(const CheckpointManifest& manifest);

// Parses the tally.json text of the file at `path` (named in messages):
// DATA_LOSS naming the file and the field for text beyond kConfigJsonLimits
// (base/json_reader.h), a missing or mistyped field or an invalid LoRA
// section; INVALID_ARGUMENT for a format_version newer than this build reads.
absl::StatusOr<CheckpointManifest> ParseCheckpointManifest(
    absl::string_view text, const std::string& path);

}  // namespace tally

#endif  // TALLY_RUNTIME_CHECKPOINT_CHECKPOINT_MANIFEST_H_
