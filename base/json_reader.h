// JsonReader: the one way tally parses JSON a client can point the server at
// (config.json, model.safetensors.index.json, adapter_config.json, tally's
// tally.json, a safetensors header). A file kind's JsonLimits bound its size
// and how deeply it may nest arrays and objects; the nesting is measured on
// the text before it is parsed, as nlohmann copies, compares and dumps values
// recursively and a few hundred KB of brackets would overflow the stack.
// Errors carry the caller's code (DATA_LOSS for a file tally wrote,
// INVALID_ARGUMENT for one a client supplies), name the file, and quote
// values through JsonExcerpt: never more than a short prefix.
//
//   TALLY_ASSIGN_OR_RETURN(
//       nlohmann::json index,
//       tally::ReadJsonFile(path, tally::kShardIndexJsonLimits,
//                           absl::StatusCode::kDataLoss));
//   if (!index["weight_map"].is_object()) {
//     return absl::DataLossError(absl::StrCat(
//         path, ": weight_map is ", tally::JsonExcerpt(index["weight_map"])));
//   }
#ifndef TALLY_BASE_JSON_READER_H_
#define TALLY_BASE_JSON_READER_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/enum_names.h"

namespace tally {

struct JsonLimits {
  uint64_t max_bytes = 0;
  int max_depth = 0;  // arrays and objects, the outermost counting 1
};

// How deeply any JSON file tally reads may nest: real HF configs nest 3 to 4
// levels (rope_scaling, quantization_config's per-module dicts).
inline constexpr int kMaxJsonDepth = 64;
// config.json, generation_config.json, adapter_config.json and tally.json:
// a few KB in practice; a config listing per-layer fields (layer_types,
// quantization modules) of a model with hundreds of layers stays under
// 100 KB.
inline constexpr JsonLimits kConfigJsonLimits = {uint64_t{4} << 20,
                                                 kMaxJsonDepth};
// model.safetensors.index.json: one line per tensor, ~100 KB for a 70B
// Llama, ~10 MB for the largest mixture-of-experts models.
inline constexpr JsonLimits kShardIndexJsonLimits = {uint64_t{64} << 20,
                                                     kMaxJsonDepth};

// How many characters of a value an error message quotes.
inline constexpr size_t kMaxExcerptChars = 64;

// `text` when it has at most kMaxExcerptChars characters, else its prefix
// followed by "... (<size> bytes)".
std::string Excerpt(absl::string_view text);

// A value for an error message: its compact JSON, through Excerpt. The
// value must come from ParseJson or ReadJsonFile (or be built in memory):
// dump() recurses once per nesting level.
template <typename Json>
std::string JsonExcerpt(const Json& value) {
  return Excerpt(value.dump(-1, ' ', false, Json::error_handler_t::replace));
}

// Where `text` first nests arrays and objects deeper than `max_depth`, as
// the keys leading there ("weight_map.a[][]..."), quoted through Excerpt;
// nullopt when it does not. Strings are skipped; malformed JSON is left to
// the parser.
std::optional<std::string> FindJsonNestingBeyond(absl::string_view text,
                                                 int max_depth);

// Parses `text`, the contents of `file` (a path or a name for messages).
// Refused with `code`, naming `file`: text longer than limits.max_bytes,
// nesting deeper than limits.max_depth (naming where), or anything that is
// not one valid JSON value (naming the byte offset).
template <typename Json = nlohmann::json>
absl::StatusOr<Json> ParseJson(absl::string_view text, const JsonLimits& limits,
                               absl::string_view file, absl::StatusCode code);

// The JSON file at `path`, read through ReadFileUpTo and parsed with
// ParseJson. A file that cannot be read keeps its errno's code (NOT_FOUND
// when missing); a larger one than limits.max_bytes is refused with `code`
// before it is read.
template <typename Json = nlohmann::json>
absl::StatusOr<Json> ReadJsonFile(const std::string& path,
                                  const JsonLimits& limits,
                                  absl::StatusCode code);

// The typed fields of one parsed JSON object, the one set of field readers
// for every file (config.json, tally.json): each error has the reader's code
// and names the field as "<where><prefix><key>".
//
//   JsonFields fields(j, absl::StrCat(path, ": "),
//                     absl::StatusCode::kDataLoss);
//   TALLY_RETURN_IF_ERROR(fields.NonNegativeInt("step", m.step));
//   JsonFields config(j, "config.json ", absl::StatusCode::kInvalidArgument);
//   TALLY_RETURN_IF_ERROR(config.OptionalDouble("rope_theta", c.rope_theta));
class JsonFields {
 public:
  // `object` must outlive this reader; `prefix` names the object in a larger
  // one ("default_adam.").
  JsonFields(const nlohmann::json& object, std::string where,
             absl::StatusCode code, std::string prefix = "");

  // What errors start with: the file ("<path>: ").
  const std::string& where() const { return where_; }

  // `key`'s value when present and of the kind `is_kind` tests; nullptr
  // otherwise.
  const nlohmann::json* Find(const char* key, bool (nlohmann::json::*is_kind)()
                                                  const noexcept) const;
  // "<where><prefix><key> is missing or not <kind>".
  absl::Status Missing(absl::string_view key, absl::string_view kind) const;

  // Required fields: refused through Missing when absent or of another
  // kind. NonNegativeInt: "... not an integer", or "... not a non-negative
  // integer" for one outside [0, 2^63) (or the int's range).
  absl::Status NonNegativeInt(const char* key, int64_t& out) const;
  absl::Status NonNegativeInt(const char* key, int& out) const;
  absl::Status Unsigned(const char* key, uint64_t& out) const;
  absl::Status Double(const char* key, double& out) const;
  absl::Status String(const char* key, std::string& out) const;
  absl::Status Bool(const char* key, bool& out) const;
  // A string that `table` names a value (base/enum_names.h); refused with
  // the names, quoted, as the kind: "... not \"a\" or \"b\"".
  template <typename Enum, size_t N>
  absl::Status Named(const char* key, const EnumName<Enum> (&table)[N],
                     Enum& out) const {
    const nlohmann::json* v = Find(key, &nlohmann::json::is_string);
    const std::optional<Enum> value =
        v == nullptr ? std::nullopt
                     : ValueNamed(table, v->get_ref<const std::string&>());
    if (!value.has_value()) return Missing(key, NameList(table, "\""));
    out = *value;
    return absl::OkStatus();
  }

  // Optional fields: absent or null leaves `out` as it is; another kind is
  // "<where><prefix><key> must be <kind>", an integer outside int64
  // "... is out of range: <value>".
  absl::Status OptionalInt(const char* key, int64_t& out) const;
  absl::Status OptionalDouble(const char* key, double& out) const;
  absl::Status OptionalBool(const char* key, bool& out) const;

 private:
  std::string Field(absl::string_view key) const;
  // The value of an optional `key`: nullptr when absent or null, else its
  // value, refused with "must be <kind>" unless `is_kind` holds.
  absl::StatusOr<const nlohmann::json*> Optional(
      const char* key, bool (nlohmann::json::*is_kind)() const noexcept,
      absl::string_view kind) const;

  const nlohmann::json& object_;
  std::string where_;
  absl::StatusCode code_;
  std::string prefix_;
};

}  // namespace tally

#endif  // TALLY_BASE_JSON_READER_H_
