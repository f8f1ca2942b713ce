#include "runtime/config/generation_config.h"

#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/json_reader.h"
#include "base/status.h"

namespace tally {
namespace {

absl::Status BadEos(const std::string& path, const nlohmann::json& value) {
  return absl::InvalidArgumentError(
      absl::StrCat(path,
                   ": eos_token_id must be a token id (an int >= 0) or "
                   "a list of them, got ",
                   JsonExcerpt(value)));
}

bool IsTokenId(const nlohmann::json& value) {
  return value.is_number_unsigned() ||
         (value.is_number_integer() && value.get<int64_t>() >= 0);
}

// The eos_token_id of the JSON file `path`: nullopt when the file does not
// exist or names none.
absl::StatusOr<std::optional<std::vector<int64_t>>> EosOf(
    const std::string& path) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return std::nullopt;
  TALLY_ASSIGN_OR_RETURN(const nlohmann::json json,
                         ReadJsonFile(path, kConfigJsonLimits,
                                      absl::StatusCode::kInvalidArgument));
  if (!json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": must hold a JSON object"));
  }
  const auto it = json.find("eos_token_id");
  if (it == json.end() || it->is_null()) return std::nullopt;
  std::vector<int64_t> ids;
  if (IsTokenId(*it)) {
    ids.push_back(it->get<int64_t>());
    return ids;
  }
  if (!it->is_array()) return BadEos(path, *it);
  for (const nlohmann::json& id : *it) {
    if (!IsTokenId(id)) return BadEos(path, *it);
    ids.push_back(id.get<int64_t>());
  }
  return ids;
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> ReadEosTokenIds(const std::string& dir) {
  if (dir.empty()) return std::vector<int64_t>();
  for (const char* file : {"generation_config.json", "config.json"}) {
    TALLY_ASSIGN_OR_RETURN(std::optional<std::vector<int64_t>> ids,
                           EosOf((std::filesystem::path(dir) / file).string()));
    if (ids) return *std::move(ids);
  }
  return std::vector<int64_t>();
}

}  // namespace tally
