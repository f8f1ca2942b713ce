#include "runtime/checkpoint/checkpoint_manifest.h"

#include <nlohmann/json.hpp>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/json_reader.h"
#include "base/status.h"
#include "runtime/config/types.h"

namespace tally {

std::string ManifestToJson(const CheckpointManifest& m) {
  nlohmann::ordered_json j;
  j["format_version"] = m.format_version;
  j["tally_version"] = m.tally_version;
  j["step"] = m.step;
  j["dtype"] = DTypeName(m.dtype);
  j["optimizer"] = OptimizerName(m.optimizer);
  j["optimizer_step_count"] = m.optimizer_step_count;
  j["default_adam"] = {{"learning_rate", m.default_adam.learning_rate},
                       {"beta1", m.default_adam.beta1},
                       {"beta2", m.default_adam.beta2},
                       {"eps", m.default_adam.eps},
                       {"weight_decay", m.default_adam.weight_decay}};
  j["default_max_grad_norm"] = m.default_max_grad_norm;
  j["grad_sync"] = NameOf(kGradSyncNames, m.grad_sync);
  j["seed"] = m.seed;
  j["unsaved_window"] = {{"calls", m.unsaved_window.calls},
                         {"tokens", m.unsaved_window.tokens},
                         {"samples", m.unsaved_window.samples}};
  if (m.trainable_only) j["trainable_only"] = true;
  if (m.activation_checkpointing) j["activation_checkpointing"] = true;
  if (m.lora.enabled()) {
    nlohmann::ordered_json& lora = j["lora"];
    lora["rank"] = m.lora.rank;
    lora["alpha"] = m.lora.alpha;
    lora["train_attn"] = m.lora.train_attn;
    lora["train_mlp"] = m.lora.train_mlp;
    lora["train_unembed"] = m.lora.train_unembed;
    if (m.lora.seed) lora["seed"] = *m.lora.seed;
    j["base_checkpoint"] = m.base_checkpoint;
    if (!m.base_identity.empty()) j["base_identity"] = m.base_identity;
  }
  return j.dump(2) + "\n";
}

namespace {

// tally.json's "lora", "base_checkpoint" and "base_identity", when
// present.
absl::Status ReadLoraManifest(const nlohmann::json& j, const JsonFields& fields,
                              CheckpointManifest& m) {
  const auto it = j.find("lora");
  if (it == j.end()) return absl::OkStatus();
  const JsonFields lora(*it, fields.where(), absl::StatusCode::kDataLoss,
                        "lora.");
  if (!it->is_object()) return lora.Missing("", "an object");
  const nlohmann::json* rank =
      lora.Find("rank", &nlohmann::json::is_number_unsigned);
  if (rank == nullptr) return lora.Missing("rank", "a positive integer");
  m.lora.rank = rank->get<int64_t>();
  TALLY_RETURN_IF_ERROR(lora.Double("alpha", m.lora.alpha));
  for (auto [key, field] :
       {std::pair<const char*, bool*>{"train_attn", &m.lora.train_attn},
        {"train_mlp", &m.lora.train_mlp},
        {"train_unembed", &m.lora.train_unembed}}) {
    TALLY_RETURN_IF_ERROR(lora.Bool(key, *field));
  }
  if (it->contains("seed")) {
    const nlohmann::json* seed =
        lora.Find("seed", &nlohmann::json::is_number_unsigned);
    if (seed == nullptr) return lora.Missing("seed", "an integer");
    m.lora.seed = seed->get<uint64_t>();
  }
  TALLY_RETURN_IF_ERROR(fields.String("base_checkpoint", m.base_checkpoint));
  if (j.contains("base_identity")) {
    TALLY_RETURN_IF_ERROR(fields.String("base_identity", m.base_identity));
  }
  const absl::Status valid = ValidateLoraConfig(m.lora);
  if (!valid.ok()) {
    return absl::DataLossError(absl::StrCat(fields.where(), valid.message()));
  }
  return absl::OkStatus();
}

// The fields format_version 2 added: grad_sync, seed, unsaved_window and the
// optional flags.
absl::Status ReadVersion2Fields(const nlohmann::json& j,
                                const JsonFields& fields,
                                CheckpointManifest& m) {
  TALLY_RETURN_IF_ERROR(fields.Named("grad_sync", kGradSyncNames, m.grad_sync));
  TALLY_RETURN_IF_ERROR(fields.Unsigned("seed", m.seed));
  const nlohmann::json* unsaved =
      fields.Find("unsaved_window", &nlohmann::json::is_object);
  if (unsaved == nullptr) return fields.Missing("unsaved_window", "an object");
  const JsonFields window(*unsaved, fields.where(), absl::StatusCode::kDataLoss,
                          "unsaved_window.");
  WindowCounts& w = m.unsaved_window;
  for (auto [key, field] : {std::pair<const char*, int64_t*>{"calls", &w.calls},
                            {"tokens", &w.tokens},
                            {"samples", &w.samples}}) {
    TALLY_RETURN_IF_ERROR(window.NonNegativeInt(key, *field));
  }
  for (auto [key, field] :
       {std::pair<const char*, bool*>{"trainable_only", &m.trainable_only},
        {"activation_checkpointing", &m.activation_checkpointing}}) {
    if (j.contains(key)) TALLY_RETURN_IF_ERROR(fields.Bool(key, *field));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointManifest> ParseCheckpointManifest(
    absl::string_view text, const std::string& path) {
  TALLY_ASSIGN_OR_RETURN(
      const nlohmann::json j,
      ParseJson(text, kConfigJsonLimits, path, absl::StatusCode::kDataLoss));
  if (!j.is_object()) {
    return absl::DataLossError(absl::StrCat(path, " is not a JSON object"));
  }
  const JsonFields fields(j, absl::StrCat(path, ": "),
                          absl::StatusCode::kDataLoss);
  CheckpointManifest m;
  TALLY_RETURN_IF_ERROR(
      fields.NonNegativeInt("format_version", m.format_version));
  if (m.format_version > kCheckpointFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": format_version ", m.format_version,
        " is newer than this tally reads (", kCheckpointFormatVersion, ")"));
  }
  TALLY_RETURN_IF_ERROR(fields.String("tally_version", m.tally_version));
  TALLY_RETURN_IF_ERROR(fields.NonNegativeInt("step", m.step));
  TALLY_RETURN_IF_ERROR(
      fields.NonNegativeInt("optimizer_step_count", m.optimizer_step_count));
  TALLY_RETURN_IF_ERROR(fields.Named("dtype", kDTypeNames, m.dtype));
  TALLY_RETURN_IF_ERROR(
      fields.Named("optimizer", kOptimizerNames, m.optimizer));

  const nlohmann::json* adam =
      fields.Find("default_adam", &nlohmann::json::is_object);
  if (adam == nullptr) return fields.Missing("default_adam", "an object");
  const JsonFields adam_fields(*adam, fields.where(),
                               absl::StatusCode::kDataLoss, "default_adam.");
  AdamParams& a = m.default_adam;
  for (auto [key, field] :
       {std::pair<const char*, double*>{"learning_rate", &a.learning_rate},
        {"beta1", &a.beta1},
        {"beta2", &a.beta2},
        {"eps", &a.eps},
        {"weight_decay", &a.weight_decay}}) {
    TALLY_RETURN_IF_ERROR(adam_fields.Double(key, *field));
  }
  TALLY_RETURN_IF_ERROR(
      fields.Double("default_max_grad_norm", m.default_max_grad_norm));
  if (m.format_version < 2) return m;  // the fields below came with version 2
  TALLY_RETURN_IF_ERROR(ReadVersion2Fields(j, fields, m));
  TALLY_RETURN_IF_ERROR(ReadLoraManifest(j, fields, m));
  return m;
}

}  // namespace tally
