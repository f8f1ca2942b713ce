#include "runtime/model_family.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json_reader.h"
#include "runtime/families/families.h"

namespace tally {
namespace {

const std::vector<const ModelFamily*>& Families() {
  static const auto* families = new std::vector<const ModelFamily*>{
      &LlamaFamily(), &MistralFamily(), &MixtralFamily(), &Qwen2Family(),
      &Qwen3Family()};
  return *families;
}

}  // namespace

absl::StatusOr<const ModelFamily*> FindModelFamily(
    absl::string_view model_type) {
  for (const ModelFamily* family : Families()) {
    if (model_type == family->model_type()) return family;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "config.model_type \"", Excerpt(model_type),
      "\" is not supported (tally builds ",
      absl::StrJoin(SupportedModelTypes(), ", "), ")"));
}

std::vector<std::string> SupportedModelTypes() {
  std::vector<std::string> types;
  for (const ModelFamily* family : Families()) {
    types.emplace_back(family->model_type());
  }
  std::sort(types.begin(), types.end());
  return types;
}

absl::Status ReadJsonInt(const nlohmann::json& json, const char* key,
                         int64_t& out) {
  if (!json.contains(key) || json[key].is_null()) return absl::OkStatus();
  if (!json[key].is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json ", key, " must be an integer"));
  }
  // Read as int64, 2^63 and above would wrap to a negative value.
  if (json[key].is_number_unsigned() &&
      json[key].get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json ", key, " is out of range: ", json[key].get<uint64_t>()));
  }
  out = json[key].get<int64_t>();
  return absl::OkStatus();
}

absl::Status ReadJsonDouble(const nlohmann::json& json, const char* key,
                            double& out) {
  if (!json.contains(key) || json[key].is_null()) return absl::OkStatus();
  if (!json[key].is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json ", key, " must be a number"));
  }
  out = json[key].get<double>();
  return absl::OkStatus();
}

absl::Status ReadJsonBool(const nlohmann::json& json, const char* key,
                          bool& out) {
  if (!json.contains(key) || json[key].is_null()) return absl::OkStatus();
  if (!json[key].is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json ", key, " must be a boolean"));
  }
  out = json[key].get<bool>();
  return absl::OkStatus();
}

absl::Status RefuseField(bool set, const char* field, const ModelFamily& family,
                         absl::string_view why) {
  if (!set) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "config.", field, " does not apply to ", family.model_type(), ": ", why));
}

}  // namespace tally
