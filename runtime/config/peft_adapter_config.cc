#include "runtime/config/peft_adapter_config.h"

#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json_reader.h"
#include "base/status.h"

namespace tally {
namespace {

constexpr char kFile[] = "adapter_config.json";

// Checks a PEFT adapter_config.json object against `lora`. A field of the
// wrong JSON type throws nlohmann::json::type_error.
absl::Status CheckFields(const std::string& dir, const nlohmann::json& config,
                         const LoraConfig& lora) {
  if (config.value("peft_type", "LORA") != "LORA") {
    return InitAdapterError(dir, "peft_type is not LORA");
  }
  if (config.value("use_rslora", false) || config.value("use_dora", false) ||
      config.value("fan_in_fan_out", false) ||
      config.value("bias", "none") != "none") {
    return InitAdapterError(
        dir, "only plain LoRA (no rslora, dora, fan_in_fan_out or bias) loads");
  }
  // Options that would make some modules or layers differ from the one
  // rank, alpha and target set tally applies everywhere.
  for (const char* key :
       {"rank_pattern", "alpha_pattern", "layers_to_transform",
        "layers_pattern", "modules_to_save"}) {
    const auto it = config.find(key);
    if (it != config.end() && !it->is_null() &&
        !(it->is_object() && it->empty()) && !(it->is_array() && it->empty())) {
      return InitAdapterError(dir, absl::StrCat(key, " is not implemented"));
    }
  }
  LoraConfig saved = lora;
  saved.rank = config.value("r", int64_t{-1});
  saved.alpha = config.value("lora_alpha", -1.0);
  const nlohmann::json modules =
      config.value("target_modules", nlohmann::json());
  const std::vector<std::string> expected = LoraTargetModules(lora);
  if (!modules.is_array() ||
      std::set<nlohmann::json>(modules.begin(), modules.end()) !=
          std::set<nlohmann::json>(expected.begin(), expected.end())) {
    return InitAdapterError(
        dir,
        absl::StrCat("target_modules is not [", absl::StrJoin(expected, ", "),
                     "] (lora.train_attn, train_mlp, train_unembed)"));
  }
  if (!SameAdapterShape(saved, lora)) {
    return InitAdapterError(
        dir, absl::StrCat("r ", saved.rank, " and lora_alpha ", saved.alpha,
                          " are not lora.rank ", lora.rank, " and lora.alpha ",
                          lora.alpha));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status InitAdapterError(const std::string& dir, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("lora.init_adapter ", dir, ": ", what));
}

absl::Status CheckPeftAdapterConfig(absl::string_view text,
                                    const std::string& dir,
                                    const LoraConfig& lora) {
  absl::StatusOr<nlohmann::json> config = ParseJson(
      text, kConfigJsonLimits, kFile, absl::StatusCode::kInvalidArgument);
  if (!config.ok()) return InitAdapterError(dir, config.status().message());
  if (!config->is_object()) {
    return InitAdapterError(dir, absl::StrCat(kFile, " is not a JSON object"));
  }
  try {
    return CheckFields(dir, *config, lora);
  } catch (const nlohmann::json::exception& e) {
    // e.what() names the expected and actual types, never a value.
    return InitAdapterError(
        dir,
        absl::StrCat(kFile, " has a field of the wrong type (", e.what(), ")"));
  }
}

}  // namespace tally
