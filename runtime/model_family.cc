#include "runtime/model_family.h"

#include <algorithm>

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
  return absl::InvalidArgumentError(
      absl::StrCat("config.model_type \"", Excerpt(model_type),
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

namespace {

// config.json's fields through the one set of field readers
// (base/json_reader.h).
JsonFields ConfigFields(const nlohmann::json& json) {
  return JsonFields(json, "config.json ", absl::StatusCode::kInvalidArgument);
}

}  // namespace

absl::Status ReadJsonInt(const nlohmann::json& json, const char* key,
                         int64_t& out) {
  return ConfigFields(json).OptionalInt(key, out);
}

absl::Status ReadJsonDouble(const nlohmann::json& json, const char* key,
                            double& out) {
  return ConfigFields(json).OptionalDouble(key, out);
}

absl::Status ReadJsonBool(const nlohmann::json& json, const char* key,
                          bool& out) {
  return ConfigFields(json).OptionalBool(key, out);
}

absl::Status RefuseField(bool set, const char* field, const ModelFamily& family,
                         absl::string_view why) {
  if (!set) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "config.", field, " does not apply to ", family.model_type(), ": ", why));
}

}  // namespace tally
