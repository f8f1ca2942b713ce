#include "base/json_reader.h"

#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/file_text.h"
#include "base/status.h"

namespace tally {
namespace {

// How much of one key a nesting path quotes.
constexpr size_t kMaxKeyChars = 32;

// An array or object open at some point of a scan: for an object, the key
// whose value is being scanned.
struct OpenContainer {
  bool object = false;
  absl::string_view key;
};

std::string PathTo(const std::vector<OpenContainer>& open) {
  std::string path;
  for (const OpenContainer& c : open) {
    if (!c.object) {
      path += "[]";
    } else {
      if (!path.empty()) path += '.';
      path += std::string(c.key.substr(0, kMaxKeyChars));
    }
    if (path.size() > kMaxExcerptChars) break;
  }
  return path.empty() ? "the top level" : path;
}

}  // namespace

std::string Excerpt(absl::string_view text) {
  if (text.size() <= kMaxExcerptChars) return std::string(text);
  return absl::StrCat(text.substr(0, kMaxExcerptChars), "... (", text.size(),
                      " bytes)");
}

std::optional<std::string> FindJsonNestingBeyond(absl::string_view text,
                                                 int max_depth) {
  std::vector<OpenContainer> open;
  absl::string_view last_string;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '"') {
      const size_t start = i + 1;
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\\') ++i;  // the escaped character
      }
      last_string = text.substr(start, std::min(i, text.size()) - start);
    } else if (c == ':') {
      if (!open.empty()) open.back().key = last_string;
    } else if (c == '[' || c == '{') {
      if (static_cast<int>(open.size()) >= max_depth) {
        return Excerpt(PathTo(open));
      }
      open.push_back({c == '{', {}});
    } else if ((c == ']' || c == '}') && !open.empty()) {
      open.pop_back();
    }
  }
  return std::nullopt;
}

template <typename Json>
absl::StatusOr<Json> ParseJson(absl::string_view text, const JsonLimits& limits,
                               absl::string_view file, absl::StatusCode code) {
  if (text.size() > limits.max_bytes) {
    return absl::Status(
        code, absl::StrCat(file, " is ", text.size(), " bytes, more than the ",
                           limits.max_bytes, "-byte limit for this file"));
  }
  if (std::optional<std::string> where =
          FindJsonNestingBeyond(text, limits.max_depth)) {
    return absl::Status(
        code, absl::StrCat(file, " nests arrays and objects deeper than ",
                           limits.max_depth, " levels (at ", *where, ")"));
  }
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    // e.what() quotes the last token read, which may be long.
    return absl::Status(
        code, absl::StrCat(file, " is not valid JSON (at byte ", e.byte, ")"));
  } catch (const nlohmann::json::exception&) {
    return absl::Status(code, absl::StrCat(file, " is not valid JSON"));
  }
}

template <typename Json>
absl::StatusOr<Json> ReadJsonFile(const std::string& path,
                                  const JsonLimits& limits,
                                  absl::StatusCode code) {
  TALLY_ASSIGN_OR_RETURN(const std::string text,
                         ReadFileUpTo(path, limits.max_bytes, code));
  return ParseJson<Json>(text, limits, path, code);
}

template absl::StatusOr<nlohmann::json> ParseJson<nlohmann::json>(
    absl::string_view, const JsonLimits&, absl::string_view, absl::StatusCode);
template absl::StatusOr<nlohmann::ordered_json>
ParseJson<nlohmann::ordered_json>(absl::string_view, const JsonLimits&,
                                  absl::string_view, absl::StatusCode);
template absl::StatusOr<nlohmann::json> ReadJsonFile<nlohmann::json>(
    const std::string&, const JsonLimits&, absl::StatusCode);
template absl::StatusOr<nlohmann::ordered_json>
ReadJsonFile<nlohmann::ordered_json>(const std::string&, const JsonLimits&,
                                     absl::StatusCode);

JsonFields::JsonFields(const nlohmann::json& object, std::string where,
                       absl::StatusCode code, std::string prefix)
    : object_(object),
      where_(std::move(where)),
      code_(code),
      prefix_(std::move(prefix)) {}

std::string JsonFields::Field(absl::string_view key) const {
  return absl::StrCat(where_, prefix_, key);
}

const nlohmann::json* JsonFields::Find(const char* key,
                                       bool (nlohmann::json::*is_kind)()
                                           const noexcept) const {
  const auto it = object_.find(key);
  return it != object_.end() && ((*it).*is_kind)() ? &*it : nullptr;
}

absl::Status JsonFields::Missing(absl::string_view key,
                                 absl::string_view kind) const {
  return absl::Status(code_,
                      absl::StrCat(Field(key), " is missing or not ", kind));
}

absl::Status JsonFields::NonNegativeInt(const char* key, int64_t& out) const {
  const nlohmann::json* v = Find(key, &nlohmann::json::is_number_integer);
  if (v == nullptr) return Missing(key, "an integer");
  if (!v->is_number_unsigned() ||
      v->get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Missing(key, "a non-negative integer");
  }
  out = v->get<int64_t>();
  return absl::OkStatus();
}

absl::Status JsonFields::NonNegativeInt(const char* key, int& out) const {
  int64_t value = 0;
  TALLY_RETURN_IF_ERROR(NonNegativeInt(key, value));
  if (value > std::numeric_limits<int>::max()) {
    return Missing(key, "a non-negative integer");
  }
  out = static_cast<int>(value);
  return absl::OkStatus();
}

absl::Status JsonFields::Unsigned(const char* key, uint64_t& out) const {
  const nlohmann::json* v = Find(key, &nlohmann::json::is_number_unsigned);
  if (v == nullptr) return Missing(key, "an unsigned integer");
  out = v->get<uint64_t>();
  return absl::OkStatus();
}

absl::Status JsonFields::Double(const char* key, double& out) const {
  const nlohmann::json* v = Find(key, &nlohmann::json::is_number);
  if (v == nullptr) return Missing(key, "a number");
  out = v->get<double>();
  return absl::OkStatus();
}

absl::Status JsonFields::String(const char* key, std::string& out) const {
  const nlohmann::json* v = Find(key, &nlohmann::json::is_string);
  if (v == nullptr) return Missing(key, "a string");
  out = v->get<std::string>();
  return absl::OkStatus();
}

absl::Status JsonFields::Bool(const char* key, bool& out) const {
  const nlohmann::json* v = Find(key, &nlohmann::json::is_boolean);
  if (v == nullptr) return Missing(key, "a boolean");
  out = v->get<bool>();
  return absl::OkStatus();
}

absl::StatusOr<const nlohmann::json*> JsonFields::Optional(
    const char* key, bool (nlohmann::json::*is_kind)() const noexcept,
    absl::string_view kind) const {
  const auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return nullptr;
  if (!((*it).*is_kind)()) {
    return absl::Status(code_, absl::StrCat(Field(key), " must be ", kind));
  }
  return &*it;
}

absl::Status JsonFields::OptionalInt(const char* key, int64_t& out) const {
  TALLY_ASSIGN_OR_RETURN(
      const nlohmann::json* v,
      Optional(key, &nlohmann::json::is_number_integer, "an integer"));
  if (v == nullptr) return absl::OkStatus();
  // Read as int64, 2^63 and above would wrap to a negative value.
  if (v->is_number_unsigned() &&
      v->get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::Status(
        code_,
        absl::StrCat(Field(key), " is out of range: ", v->get<uint64_t>()));
  }
  out = v->get<int64_t>();
  return absl::OkStatus();
}

absl::Status JsonFields::OptionalDouble(const char* key, double& out) const {
  TALLY_ASSIGN_OR_RETURN(const nlohmann::json* v,
                         Optional(key, &nlohmann::json::is_number, "a number"));
  if (v != nullptr) out = v->get<double>();
  return absl::OkStatus();
}

absl::Status JsonFields::OptionalBool(const char* key, bool& out) const {
  TALLY_ASSIGN_OR_RETURN(
      const nlohmann::json* v,
      Optional(key, &nlohmann::json::is_boolean, "a boolean"));
  if (v != nullptr) out = v->get<bool>();
  return absl::OkStatus();
}

}  // namespace tally
