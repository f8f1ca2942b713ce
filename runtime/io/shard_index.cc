#include "runtime/io/shard_index.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "base/json_reader.h"
#include "base/status.h"

namespace tally {

absl::StatusOr<ShardIndex> ParseShardIndex(absl::string_view text,
                                           const std::string& path) {
  TALLY_ASSIGN_OR_RETURN(const nlohmann::json index,
                         ParseJson(text, kShardIndexJsonLimits, path,
                                   absl::StatusCode::kDataLoss));
  const auto weight_map =
      index.is_object() ? index.find("weight_map") : index.end();
  if (!index.is_object() || weight_map == index.end() ||
      !weight_map->is_object()) {
    return absl::DataLossError(
        absl::StrCat(path, ": weight_map is missing or not an object"));
  }
  ShardIndex shards;
  for (const auto& [name, shard] : weight_map->items()) {
    const std::string file = shard.is_string() ? shard.get<std::string>() : "";
    // Shards live in the index's directory; a path must not reach outside.
    if (file.empty() || file == "." || file == ".." ||
        file.find('/') != std::string::npos) {
      return absl::DataLossError(
          absl::StrCat(path, ": weight_map \"", Excerpt(name), "\" names ",
                       JsonExcerpt(shard), ", not a file in the directory"));
    }
    shards[file].insert(name);
  }
  return shards;
}

}  // namespace tally
