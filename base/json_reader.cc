#include "base/json_reader.h"

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

}  // namespace tally
