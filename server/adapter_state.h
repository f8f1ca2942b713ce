// Adapter states: a CreateModel request, or a --resume, that names a LoRA
// adapter's checkpoint alone (a Tinker program's
// create_training_client_from_state(path)) becomes the adapter over its
// base, as the checkpoint's tally.json records them: the adapter's
// LoraConfig, the base's directory (or the config and seed of a drawn one)
// and the base's identity, checked so that the adapter never resumes over
// weights it was not trained on.
//
//   absl::StatusOr<bool> expanded = tally::ExpandAdapterState(
//       request, models_root,
//       [&](std::string* base) { return ConfineToTenant(base); });
//   if (expanded.ok() && *expanded) ... parse the rewritten request again
#ifndef TALLY_SERVER_ADAPTER_STATE_H_
#define TALLY_SERVER_ADAPTER_STATE_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/checkpoint/checkpoint_manifest.h"
#include "runtime/config/llama_config.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

// Confines a path a checkpoint recorded to the caller's root (rewriting it
// to the resolved path), or refuses it.
using ConfineFn = std::function<absl::Status(std::string* path)>;

// Sets `request`'s lora, init_checkpoint (or config and seed) to rebuild the
// adapter of `manifest` (the tally.json of the adapter state at `state`,
// whose config.json is `config`) over its base, with lora.init_adapter
// `state`. The recorded base is used as it is: ExpandAdapterState confines
// it first.
void AdapterOverItsBase(const CheckpointManifest& manifest,
                        const LlamaConfig& config, const std::string& state,
                        v1::CreateModelRequest& request);

// When `request` sets no lora and its init_checkpoint (already resolved
// for the caller) is a LoRA adapter's state: rewrites it as
// AdapterOverItsBase, its dtype the state's unless set, and returns true.
// The base must lie under `models_root` (when set) or pass `confine` (the
// caller's root): PERMISSION_DENIED naming it otherwise. FAILED_PRECONDITION
// naming the base when it no longer holds what the state recorded
// (CheckAdapterBase). False, untouched, for anything else: the build
// reports what is wrong with it.
absl::StatusOr<bool> ExpandAdapterState(v1::CreateModelRequest& request,
                                        const std::string& models_root,
                                        const ConfineFn& confine);

}  // namespace tally

#endif  // TALLY_SERVER_ADAPTER_STATE_H_
