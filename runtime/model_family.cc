#include "runtime/model_family.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace tally {

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
