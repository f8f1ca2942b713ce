#include "client/tokenizer_json.h"

#include <algorithm>
#include <array>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "base/json_reader.h"
#include "base/status.h"

namespace tally {
namespace {

// tokenizer.json files run to ~10 MB (Llama 3, Qwen) and a few tens of MB
// for the largest vocabularies; they nest a handful of levels.
constexpr JsonLimits kTokenizerJsonLimits = {uint64_t{128} << 20,
                                             kMaxJsonDepth};
// Ids beyond this are refused rather than allocated for: the largest real
// vocabularies hold ~262k tokens.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;
constexpr char32_t kReplacementChar = 0xFFFD;

void AppendUtf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

// The length of the valid UTF-8 prefix of `s` that starts one character
// (1 to 4 bytes), or 0 with `*consumed` the bytes of its maximal invalid
// subpart (at least 1) when it is not a whole character.
size_t Utf8CharLength(absl::string_view s, size_t* consumed) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char b = byte(0);
  *consumed = 1;
  if (b < 0x80) return 1;
  size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;  // the second byte's range
  if (b >= 0xC2 && b <= 0xDF) {
    length = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    length = 3;
    if (b == 0xE0) low = 0xA0;
    if (b == 0xED) high = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    length = 4;
    if (b == 0xF0) low = 0x90;
    if (b == 0xF4) high = 0x8F;
  } else {
    return 0;
  }
  for (size_t i = 1; i < length; ++i) {
    if (i >= s.size()) return 0;
    const unsigned char lo = i == 1 ? low : 0x80, hi = i == 1 ? high : 0xBF;
    if (byte(i) < lo || byte(i) > hi) return 0;
    *consumed = i + 1;
  }
  return length;
}

// The code points of `text`, which must be UTF-8 (as every JSON string is;
// anything else reads as U+FFFD).
std::vector<char32_t> CodePoints(absl::string_view text) {
  std::vector<char32_t> points;
  while (!text.empty()) {
    size_t consumed = 0;
    const size_t length = Utf8CharLength(text, &consumed);
    if (length == 0) {
      points.push_back(kReplacementChar);
      text.remove_prefix(consumed);
      continue;
    }
    char32_t c = static_cast<unsigned char>(text[0]);
    if (length > 1) c &= 0x7F >> length;
    for (size_t i = 1; i < length; ++i) {
      c = (c << 6) | (static_cast<unsigned char>(text[i]) & 0x3F);
    }
    points.push_back(c);
    text.remove_prefix(length);
  }
  return points;
}

std::string FromCodePoints(const std::vector<char32_t>& points, size_t begin,
                           size_t end) {
  std::string text;
  for (size_t i = begin; i < end; ++i) AppendUtf8(points[i], text);
  return text;
}

absl::Status FieldError(const std::string& where, absl::string_view field,
                        absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": ", field, " ", problem));
}

// A decoder field that is one character ("replacement", Strip's "content").
absl::StatusOr<char32_t> OneChar(const nlohmann::json& decoder, const char* key,
                                 char32_t fallback, const std::string& where,
                                 const std::string& field) {
  const auto it = decoder.find(key);
  if (it == decoder.end()) return fallback;
  if (it->is_string()) {
    const std::vector<char32_t> points =
        CodePoints(it->get_ref<const std::string&>());
    if (points.size() == 1) return points[0];
  }
  return FieldError(where, absl::StrCat(field, ".", key),
                    absl::StrCat("is not one character: ", JsonExcerpt(*it)));
}

// GPT-2's byte-level alphabet: each byte as a printable code point.
class ByteLevelDecoder : public TokenDecoder {
 public:
  ByteLevelDecoder() {
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_of_.emplace_back(printable ? b : next++, static_cast<char>(b));
    }
    std::sort(byte_of_.begin(), byte_of_.end());
  }

  std::vector<std::string> DecodeChain(
      std::vector<std::string> tokens) const override {
    std::string bytes;
    for (const std::string& token : tokens) {
      std::string token_bytes;
      bool mapped = true;
      for (char32_t c : CodePoints(token)) {
        const auto it = std::lower_bound(
            byte_of_.begin(), byte_of_.end(), std::make_pair(c, '\0'),
            [](const auto& a, const auto& b) { return a.first < b.first; });
        if (it == byte_of_.end() || it->first != c) {
          mapped = false;  // not byte-level (an added token): as it is
          break;
        }
        token_bytes += it->second;
      }
      bytes += mapped ? token_bytes : token;
    }
    return {Utf8Lossy(bytes)};
  }

 private:
  std::vector<std::pair<char32_t, char>> byte_of_;  // sorted by code point
};

// SentencePiece's "▁" for a space; the first token's is dropped unless the
// prepend scheme is "never".
class MetaspaceDecoder : public TokenDecoder {
 public:
  MetaspaceDecoder(char32_t replacement, bool strip_first)
      : replacement_(replacement), strip_first_(strip_first) {}

  std::vector<std::string> DecodeChain(
      std::vector<std::string> tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string text;
      for (char32_t c : CodePoints(tokens[i])) {
        if (c != replacement_) {
          AppendUtf8(c, text);
        } else if (i != 0 || !strip_first_) {
          text += ' ';
        }
      }
      tokens[i] = std::move(text);
    }
    return tokens;
  }

 private:
  char32_t replacement_;
  bool strip_first_;
};

class ReplaceDecoder : public TokenDecoder {
 public:
  ReplaceDecoder(std::string pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}

  std::vector<std::string> DecodeChain(
      std::vector<std::string> tokens) const override {
    for (std::string& token : tokens) {
      token = absl::StrReplaceAll(token, {{pattern_, content_}});
    }
    return tokens;
  }

 private:
  std::string pattern_;
  std::string content_;
};

// Runs of "<0xNN>" tokens become their bytes: one string when they are
// UTF-8, else one U+FFFD per byte.
class ByteFallbackDecoder : public TokenDecoder {
 public:
  std::vector<std::string> DecodeChain(
      std::vector<std::string> tokens) const override {
    std::vector<std::string> decoded;
    std::string bytes;
    size_t byte_count = 0;
    const auto flush = [&] {
      if (byte_count == 0) return;
      if (Utf8Lossy(bytes) == bytes) {
        decoded.push_back(bytes);
      } else {
        std::string replacement;
        AppendUtf8(kReplacementChar, replacement);
        for (size_t i = 0; i < byte_count; ++i) decoded.push_back(replacement);
      }
      bytes.clear();
      byte_count = 0;
    };
    for (std::string& token : tokens) {
      const std::optional<char> byte = ByteToken(token);
      if (byte.has_value()) {
        bytes += *byte;
        ++byte_count;
        continue;
      }
      flush();
      decoded.push_back(std::move(token));
    }
    flush();
    return decoded;
  }

 private:
  static std::optional<char> ByteToken(const std::string& token) {
    if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 ||
        token[5] != '>') {
      return std::nullopt;
    }
    int value = 0;
    for (char c : token.substr(3, 2)) {
      const int digit = (c >= '0' && c <= '9')   ? c - '0'
                        : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                        : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                                                 : -1;
      if (digit < 0) return std::nullopt;
      value = value * 16 + digit;
    }
    return static_cast<char>(value);
  }
};

class FuseDecoder : public TokenDecoder {
 public:
  std::vector<std::string> DecodeChain(
      std::vector<std::string> tokens) const override {
    return {absl::StrJoin(tokens, "")};
  }
};

// Drops up to `start` leading and `stop` trailing `content` characters of
// each token.
class StripDecoder : public TokenDecoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}

  std::vector<std::string> DecodeChain(
      std::vector<std::string> tokens) const override {
    for (std::string& token : tokens) {
      const std::vector<char32_t> points = CodePoints(token);
      size_t begin = 0, end = points.size();
      while (begin < std::min(start_, end) && points[begin] == content_) {
        ++begin;
      }
      for (size_t i = 0; i < stop_ && end > begin; ++i) {
        if (points[end - 1] != content_) break;
        --end;
      }
      token = FromCodePoints(points, begin, end);
    }
    return tokens;
  }

 private:
  char32_t content_;
  size_t start_;
  size_t stop_;
};

class SequenceDecoder : public TokenDecoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<TokenDecoder>> steps)
      : steps_(std::move(steps)) {}

  std::vector<std::string> DecodeChain(
      std::vector<std::string> tokens) const override {
    for (const auto& step : steps_) tokens = step->DecodeChain(tokens);
    return tokens;
  }

 private:
  std::vector<std::unique_ptr<TokenDecoder>> steps_;
};

absl::StatusOr<std::unique_ptr<TokenDecoder>> MakeMetaspace(
    const nlohmann::json& decoder, const std::string& where,
    const std::string& field) {
  TALLY_ASSIGN_OR_RETURN(
      char32_t replacement,
      OneChar(decoder, "replacement", U'\u2581', where, field));
  bool strip_first = true;
  const auto scheme = decoder.find("prepend_scheme");
  const auto legacy = decoder.find("add_prefix_space");
  if (scheme != decoder.end()) {
    if (!scheme->is_string() ||
        (*scheme != "always" && *scheme != "first" && *scheme != "never")) {
      return FieldError(where, field + ".prepend_scheme",
                        absl::StrCat("is not \"always\", \"first\" or "
                                     "\"never\": ",
                                     JsonExcerpt(*scheme)));
    }
    strip_first = *scheme != "never";
  } else if (legacy != decoder.end() && legacy->is_boolean()) {
    strip_first = legacy->get<bool>();
  }
  return std::make_unique<MetaspaceDecoder>(replacement, strip_first);
}

absl::StatusOr<std::unique_ptr<TokenDecoder>> MakeReplace(
    const nlohmann::json& decoder, const std::string& where,
    const std::string& field) {
  const auto pattern = decoder.find("pattern");
  const auto content = decoder.find("content");
  if (pattern == decoder.end() || !pattern->is_object() ||
      !pattern->contains("String") || !(*pattern)["String"].is_string() ||
      (*pattern)["String"].get_ref<const std::string&>().empty()) {
    return FieldError(
        where, field + ".pattern",
        absl::StrCat(
            "is not {\"String\": <non-empty text>} (Regex patterns "
            "are not supported): ",
            pattern == decoder.end() ? "missing" : JsonExcerpt(*pattern)));
  }
  if (content == decoder.end() || !content->is_string()) {
    return FieldError(where, field + ".content", "is missing or not a string");
  }
  return std::make_unique<ReplaceDecoder>(
      (*pattern)["String"].get<std::string>(), content->get<std::string>());
}

absl::StatusOr<std::unique_ptr<TokenDecoder>> MakeStrip(
    const nlohmann::json& decoder, const std::string& where,
    const std::string& field) {
  TALLY_ASSIGN_OR_RETURN(char32_t content,
                         OneChar(decoder, "content", U' ', where, field));
  std::array<size_t, 2> counts = {0, 0};
  const char* keys[] = {"start", "stop"};
  for (int i = 0; i < 2; ++i) {
    const auto it = decoder.find(keys[i]);
    if (it == decoder.end()) continue;
    if (!it->is_number_unsigned()) {
      return FieldError(where, absl::StrCat(field, ".", keys[i]),
                        "is not an integer >= 0");
    }
    counts[i] = it->get<size_t>();
  }
  return std::make_unique<StripDecoder>(content, counts[0], counts[1]);
}

absl::StatusOr<std::unique_ptr<TokenDecoder>> MakeDecoderAt(
    const nlohmann::json& decoder, const std::string& where,
    const std::string& field) {
  if (!decoder.is_object() || !decoder.contains("type") ||
      !decoder["type"].is_string()) {
    return FieldError(where, field,
                      absl::StrCat("is not an object with a \"type\": ",
                                   JsonExcerpt(decoder)));
  }
  const std::string& type = decoder["type"].get_ref<const std::string&>();
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") return MakeMetaspace(decoder, where, field);
  if (type == "Replace") return MakeReplace(decoder, where, field);
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") return MakeStrip(decoder, where, field);
  if (type == "Sequence") {
    const auto steps = decoder.find("decoders");
    if (steps == decoder.end() || !steps->is_array()) {
      return FieldError(where, field + ".decoders",
                        "is missing or not an array");
    }
    std::vector<std::unique_ptr<TokenDecoder>> chain;
    for (size_t i = 0; i < steps->size(); ++i) {
      TALLY_ASSIGN_OR_RETURN(
          std::unique_ptr<TokenDecoder> step,
          MakeDecoderAt((*steps)[i], where,
                        absl::StrCat(field, ".decoders[", i, "]")));
      chain.push_back(std::move(step));
    }
    return std::make_unique<SequenceDecoder>(std::move(chain));
  }
  return FieldError(
      where, field + ".type",
      absl::StrCat("'", Excerpt(type),
                   "' is not a decoder tallyctl reads (ByteLevel, Metaspace, "
                   "Replace, ByteFallback, Fuse, Strip, Sequence)"));
}

// An id from a tokenizer.json field, refused past kMaxTokenId.
absl::StatusOr<int32_t> TokenId(const nlohmann::json& value,
                                const std::string& where,
                                const std::string& field) {
  if (!value.is_number_unsigned() || value.get<uint64_t>() >= kMaxTokenId) {
    return FieldError(where, field,
                      absl::StrCat("is not a token id in [0, ", kMaxTokenId,
                                   "): ", JsonExcerpt(value)));
  }
  return value.get<int32_t>();
}

}  // namespace

std::string Utf8Lossy(absl::string_view bytes) {
  std::string text;
  text.reserve(bytes.size());
  while (!bytes.empty()) {
    size_t consumed = 0;
    const size_t length = Utf8CharLength(bytes, &consumed);
    if (length == 0) {
      AppendUtf8(kReplacementChar, text);
      bytes.remove_prefix(consumed);
    } else {
      text.append(bytes.data(), length);
      bytes.remove_prefix(length);
    }
  }
  return text;
}

absl::StatusOr<std::unique_ptr<TokenDecoder>> MakeTokenDecoder(
    const nlohmann::json& decoder, const std::string& where) {
  if (decoder.is_null()) return nullptr;
  return MakeDecoderAt(decoder, where, "decoder");
}

absl::StatusOr<TokenizerJson> TokenizerJson::Load(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/tokenizer.json");
  TALLY_ASSIGN_OR_RETURN(nlohmann::json json,
                         ReadJsonFile(path, kTokenizerJsonLimits,
                                      absl::StatusCode::kInvalidArgument));
  return FromJson(json, path);
}

absl::StatusOr<TokenizerJson> TokenizerJson::FromJson(
    const nlohmann::json& json, const std::string& where) {
  TokenizerJson tokenizer;
  tokenizer.where_ = where;
  const auto set = [&](int32_t id, std::string content, bool special) {
    if (static_cast<size_t>(id) >= tokenizer.tokens_.size()) {
      tokenizer.tokens_.resize(id + 1);
    }
    tokenizer.tokens_[id] = {std::move(content), true, special};
  };
  if (!json.is_object() || !json.contains("model") ||
      !json["model"].is_object() || !json["model"].contains("vocab")) {
    return FieldError(where, "model.vocab", "is missing");
  }
  const nlohmann::json& vocab = json["model"]["vocab"];
  if (vocab.is_object()) {
    for (const auto& [token, id_value] : vocab.items()) {
      TALLY_ASSIGN_OR_RETURN(
          int32_t id,
          TokenId(id_value, where,
                  absl::StrCat("model.vocab[\"", Excerpt(token), "\"]")));
      set(id, token, false);
    }
  } else if (vocab.is_array() && vocab.size() < kMaxTokenId) {
    for (size_t id = 0; id < vocab.size(); ++id) {  // Unigram: [piece, score]
      const nlohmann::json& entry = vocab[id];
      if (!entry.is_array() || entry.empty() || !entry[0].is_string()) {
        return FieldError(
            where, absl::StrCat("model.vocab[", id, "]"),
            absl::StrCat("is not [piece, score]: ", JsonExcerpt(entry)));
      }
      set(static_cast<int32_t>(id), entry[0].get<std::string>(), false);
    }
  } else {
    return FieldError(where, "model.vocab",
                      "is not a {token: id} object or a [[piece, score], "
                      "...] list");
  }
  const auto added = json.find("added_tokens");
  if (added != json.end() && !added->is_null()) {
    if (!added->is_array()) {
      return FieldError(where, "added_tokens", "is not an array");
    }
    for (size_t i = 0; i < added->size(); ++i) {
      const nlohmann::json& token = (*added)[i];
      const std::string field = absl::StrCat("added_tokens[", i, "]");
      if (!token.is_object() || !token.contains("id") ||
          !token.contains("content") || !token["content"].is_string()) {
        return FieldError(where, field,
                          "is not an object with an id and a content");
      }
      TALLY_ASSIGN_OR_RETURN(int32_t id,
                             TokenId(token["id"], where, field + ".id"));
      const auto special = token.find("special");
      set(id, token["content"].get<std::string>(),
          special != token.end() && special->is_boolean() &&
              special->get<bool>());
    }
  }
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<TokenDecoder> decoder,
      MakeTokenDecoder(json.value("decoder", nlohmann::json()), where));
  tokenizer.decoder_ = std::move(decoder);
  return tokenizer;
}

absl::StatusOr<std::string> TokenizerJson::Decode(
    absl::Span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= size() || !tokens_[id].present) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " has no token in ", where_,
                       " (ids up to ", size() - 1, ")"));
    }
    if (skip_special_tokens && tokens_[id].special) continue;
    tokens.push_back(tokens_[id].content);
  }
  if (decoder_ == nullptr) return Utf8Lossy(absl::StrJoin(tokens, " "));
  return Utf8Lossy(absl::StrJoin(decoder_->DecodeChain(std::move(tokens)), ""));
}

}  // namespace tally
