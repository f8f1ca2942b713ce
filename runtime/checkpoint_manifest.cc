#include "runtime/checkpoint_manifest.h"

#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/json_reader.h"
#include "base/status.h"

namespace tally {
namespace {

// The inverse of a `const char* Name(Enum)` function over `values`.
template <typename Enum>
std::optional<Enum> ParseEnum(const std::string& name,
                              std::initializer_list<Enum> values,
                              const char* (*name_of)(Enum)) {
  for (Enum value : values) {
    if (name == name_of(value)) return value;
  }
  return std::nullopt;
}

const char* GradSyncName(GradSync sync) {
  return sync == GradSync::kDeferred ? "deferred" : "eager";
}

}  // namespace

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
  j["grad_sync"] = GradSyncName(m.grad_sync);
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
  }
  return j.dump(2) + "\n";
}

namespace {

// tally.json's "lora" and "base_checkpoint", when present.
absl::Status ReadLoraManifest(const nlohmann::json& j, const std::string& path,
                              CheckpointManifest& m) {
  const auto it = j.find("lora");
  if (it == j.end()) return absl::OkStatus();
  auto bad = [&](const char* field, const char* kind) {
    return absl::DataLossError(
        absl::StrCat(path, ": lora.", field, " is missing or not ", kind));
  };
  const nlohmann::json& lora = *it;
  if (!lora.is_object()) return bad("", "an object");
  if (!lora.contains("rank") || !lora["rank"].is_number_unsigned()) {
    return bad("rank", "a positive integer");
  }
  m.lora.rank = lora["rank"].get<int64_t>();
  if (!lora.contains("alpha") || !lora["alpha"].is_number()) {
    return bad("alpha", "a number");
  }
  m.lora.alpha = lora["alpha"].get<double>();
  for (auto [key, field] :
       {std::pair<const char*, bool*>{"train_attn", &m.lora.train_attn},
        {"train_mlp", &m.lora.train_mlp},
        {"train_unembed", &m.lora.train_unembed}}) {
    if (!lora.contains(key) || !lora[key].is_boolean()) {
      return bad(key, "a boolean");
    }
    *field = lora[key].get<bool>();
  }
  if (lora.contains("seed")) {
    if (!lora["seed"].is_number_unsigned()) return bad("seed", "an integer");
    m.lora.seed = lora["seed"].get<uint64_t>();
  }
  const auto base = j.find("base_checkpoint");
  if (base == j.end() || !base->is_string()) {
    return absl::DataLossError(
        absl::StrCat(path, ": base_checkpoint is missing or not a string"));
  }
  m.base_checkpoint = base->get<std::string>();
  const absl::Status valid = ValidateLoraConfig(m.lora);
  if (!valid.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": ", valid.message()));
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
  auto bad = [&](const std::string& field, const char* kind) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", field, " is missing or not ", kind));
  };
  // Finds `key` in `object` when `is_kind` holds for it.
  auto find = [](const nlohmann::json& object, const char* key,
                 bool (nlohmann::json::*is_kind)()
                     const noexcept) -> const nlohmann::json* {
    const auto it = object.find(key);
    return it != object.end() && ((*it).*is_kind)() ? &*it : nullptr;
  };
  auto read_int = [&](const char* key, auto& out) -> absl::Status {
    const nlohmann::json* v = find(j, key, &nlohmann::json::is_number_integer);
    if (v == nullptr) return bad(key, "an integer");
    out = v->get<std::remove_reference_t<decltype(out)>>();
    if (out < 0) return bad(key, "a non-negative integer");
    return absl::OkStatus();
  };
  auto read_double = [&](const nlohmann::json& object,
                         const std::string& field_prefix, const char* key,
                         double& out) -> absl::Status {
    const nlohmann::json* v = find(object, key, &nlohmann::json::is_number);
    if (v == nullptr) return bad(field_prefix + key, "a number");
    out = v->get<double>();
    return absl::OkStatus();
  };
  auto read_string = [&](const char* key, std::string& out) -> absl::Status {
    const nlohmann::json* v = find(j, key, &nlohmann::json::is_string);
    if (v == nullptr) return bad(key, "a string");
    out = v->get<std::string>();
    return absl::OkStatus();
  };

  CheckpointManifest m;
  TALLY_RETURN_IF_ERROR(read_int("format_version", m.format_version));
  if (m.format_version > kCheckpointFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": format_version ", m.format_version,
        " is newer than this tally reads (", kCheckpointFormatVersion, ")"));
  }
  TALLY_RETURN_IF_ERROR(read_string("tally_version", m.tally_version));
  TALLY_RETURN_IF_ERROR(read_int("step", m.step));
  TALLY_RETURN_IF_ERROR(
      read_int("optimizer_step_count", m.optimizer_step_count));

  std::string name;
  TALLY_RETURN_IF_ERROR(read_string("dtype", name));
  const std::optional<DType> dtype = DTypeNamed(name);
  if (!dtype) return bad("dtype", "\"float32\", \"float64\" or \"bfloat16\"");
  m.dtype = *dtype;
  TALLY_RETURN_IF_ERROR(read_string("optimizer", name));
  const std::optional<OptimizerKind> optimizer = ParseEnum(
      name, {OptimizerKind::kAdamW, OptimizerKind::kSgd}, &OptimizerName);
  if (!optimizer) return bad("optimizer", "\"adamw\" or \"sgd\"");
  m.optimizer = *optimizer;

  const nlohmann::json* adam =
      find(j, "default_adam", &nlohmann::json::is_object);
  if (adam == nullptr) return bad("default_adam", "an object");
  AdamParams& a = m.default_adam;
  for (auto [key, field] :
       {std::pair<const char*, double*>{"learning_rate", &a.learning_rate},
        {"beta1", &a.beta1},
        {"beta2", &a.beta2},
        {"eps", &a.eps},
        {"weight_decay", &a.weight_decay}}) {
    TALLY_RETURN_IF_ERROR(read_double(*adam, "default_adam.", key, *field));
  }
  TALLY_RETURN_IF_ERROR(
      read_double(j, "", "default_max_grad_norm", m.default_max_grad_norm));
  if (m.format_version < 2) return m;  // the fields below came with version 2

  TALLY_RETURN_IF_ERROR(read_string("grad_sync", name));
  const std::optional<GradSync> grad_sync =
      ParseEnum(name, {GradSync::kEager, GradSync::kDeferred}, &GradSyncName);
  if (!grad_sync) return bad("grad_sync", "\"eager\" or \"deferred\"");
  m.grad_sync = *grad_sync;
  const nlohmann::json* seed =
      find(j, "seed", &nlohmann::json::is_number_unsigned);
  if (seed == nullptr) return bad("seed", "an unsigned integer");
  m.seed = seed->get<uint64_t>();
  const nlohmann::json* unsaved =
      find(j, "unsaved_window", &nlohmann::json::is_object);
  if (unsaved == nullptr) return bad("unsaved_window", "an object");
  WindowCounts& w = m.unsaved_window;
  for (auto [key, field] : {std::pair<const char*, int64_t*>{"calls", &w.calls},
                            {"tokens", &w.tokens},
                            {"samples", &w.samples}}) {
    const nlohmann::json* v =
        find(*unsaved, key, &nlohmann::json::is_number_unsigned);
    if (v == nullptr ||
        v->get<uint64_t>() >
            static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return bad(absl::StrCat("unsaved_window.", key),
                 "a non-negative integer");
    }
    *field = v->get<int64_t>();
  }
  for (auto [key, field] :
       {std::pair<const char*, bool*>{"trainable_only", &m.trainable_only},
        {"activation_checkpointing", &m.activation_checkpointing}}) {
    if (const auto it = j.find(key); it != j.end()) {
      if (!it->is_boolean()) return bad(key, "a boolean");
      *field = it->get<bool>();
    }
  }
  TALLY_RETURN_IF_ERROR(ReadLoraManifest(j, path, m));
  return m;
}

}  // namespace tally
