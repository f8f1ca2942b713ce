// ShardIndex: HF's model.safetensors.index.json, which maps each tensor of a
// sharded model to the shard file holding it. Torch-free, so the parser of
// this untrusted file is fuzzed on its own (tests/fuzz/shard_index_fuzzer.cc).
//
//   {"metadata": {"total_size": 16060522496},
//    "weight_map": {"lm_head.weight": "model-00004-of-00004.safetensors", ...}}
//
//   TALLY_ASSIGN_OR_RETURN(tally::ShardIndex index,
//                          tally::ParseShardIndex(text, index_path));
//   for (const auto& [file, names] : index) { /* read `names` from `file` */ }
#ifndef TALLY_RUNTIME_IO_SHARD_INDEX_H_
#define TALLY_RUNTIME_IO_SHARD_INDEX_H_

#include <map>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

// Shard file name -> the tensor names the index places in it.
using ShardIndex = std::map<std::string, std::set<std::string>>;

// Parses the index text of the file at `path` (named in messages).
// DATA_LOSS naming the file and the field for text beyond
// kShardIndexJsonLimits (base/json_reader.h), a weight_map that is missing or
// not an object, or a shard that is not a plain file name in the index's
// directory (quoting a short prefix of the offending value).
absl::StatusOr<ShardIndex> ParseShardIndex(absl::string_view text,
                                           const std::string& path);

}  // namespace tally

#endif  // TALLY_RUNTIME_IO_SHARD_INDEX_H_
