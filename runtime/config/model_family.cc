#include "runtime/config/model_family.h"

#include "absl/strings/str_cat.h"
#include "base/json_reader.h"

namespace tally {
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
