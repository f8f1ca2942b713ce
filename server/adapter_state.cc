#include "server/adapter_state.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/directory_identity.h"
#include "runtime/io/atomic_directory.h"
#include "server/convert.h"
#include "server/path_confinement.h"

namespace tally {
namespace {

// `base` (a path an adapter state recorded) confined to `models_root` when
// it lies there, else by `confine`; PERMISSION_DENIED naming it and `state`.
absl::Status ConfineBase(const std::string& models_root,
                         const ConfineFn& confine, const std::string& state,
                         std::string* base) {
  if (!models_root.empty()) {
    absl::StatusOr<std::string> in_models = ConfineToRoot(models_root, *base);
    if (in_models.ok()) {
      *base = *in_models;
      return absl::OkStatus();
    }
  }
  const std::string recorded = *base;
  const absl::Status confined = confine(base);
  if (confined.ok()) return confined;
  return absl::Status(
      confined.code(),
      absl::StrCat(
          "the LoRA base ", recorded, " that adapter state ", state,
          " names is outside this caller's roots: ", confined.message()));
}

}  // namespace

void AdapterOverItsBase(const CheckpointManifest& manifest,
                        const LlamaConfig& config, const std::string& state,
                        v1::CreateModelRequest& request) {
  const LoraConfig& saved = manifest.lora;
  v1::LoraConfig* lora = request.mutable_lora();
  lora->set_rank(static_cast<int32_t>(saved.rank));
  lora->set_alpha(saved.alpha);
  lora->set_train_attn(saved.train_attn);
  lora->set_train_mlp(saved.train_mlp);
  lora->set_train_unembed(saved.train_unembed);
  if (saved.seed) lora->set_seed(*saved.seed);
  lora->set_init_adapter(state);
  if (manifest.base_checkpoint.empty()) {
    // A base drawn from its config and the model's seed.
    request.clear_init_checkpoint();
    ToProto(config, request.mutable_config());
    request.set_seed(manifest.seed);
  } else {
    request.set_init_checkpoint(manifest.base_checkpoint);
  }
}

absl::StatusOr<bool> ExpandAdapterState(v1::CreateModelRequest& request,
                                        const std::string& models_root,
                                        const ConfineFn& confine) {
  if (request.has_lora() || request.init_checkpoint().empty()) return false;
  const std::string state = request.init_checkpoint();
  const absl::StatusOr<std::optional<CheckpointManifest>> manifest =
      ReadManifestIfAny(state);
  if (!manifest.ok() || !manifest->has_value() ||
      !(*manifest)->lora.enabled()) {
    return false;
  }
  CheckpointManifest m = **manifest;
  TALLY_ASSIGN_OR_RETURN(const LlamaConfig config,
                         ReadHfConfig(PublishedDir(state) + "/config.json"));
  if (!m.base_checkpoint.empty()) {
    TALLY_RETURN_IF_ERROR(
        ConfineBase(models_root, confine, state, &m.base_checkpoint));
    TALLY_RETURN_IF_ERROR(CheckAdapterBase(m, state, m.base_checkpoint));
  }
  AdapterOverItsBase(m, config, state, request);
  if (request.dtype() == v1::DTYPE_UNSPECIFIED) {
    request.set_dtype(ToProto(m.dtype));
  }
  return true;
}

}  // namespace tally
