// TokenizerJson: turns token ids back into text with a Hugging Face
// tokenizer.json, read on the client's side (tallyctl sample --tokenizer
// DIR), since the server never reveals its model directories.
//
// The vocabulary comes from "model".vocab (BPE, WordLevel and WordPiece's
// {token: id} object, or Unigram's [[piece, score], ...] list) and
// "added_tokens" (which win over the model's vocabulary for their ids). The
// "decoder" is the one HF models use, alone or in a "Sequence": ByteLevel
// (GPT-2, Llama 3, Qwen), Metaspace, Replace (string patterns), ByteFallback
// ("<0xNN>" tokens), Fuse and Strip (Llama 2, Mistral); a null decoder joins
// the tokens with spaces, as HF does. Any other decoder type is refused by
// Load, naming it. Bytes that are not UTF-8 (a character cut between tokens)
// come out as U+FFFD, never as invalid text. Encoding text is not supported.
//
//   TALLY_ASSIGN_OR_RETURN(tally::TokenizerJson tokenizer,
//                          tally::TokenizerJson::Load("/models/llama3"));
//   TALLY_ASSIGN_OR_RETURN(std::string text,
//                          tokenizer.Decode({9906, 1917},
//                          /*skip_special=*/true));
#ifndef TALLY_CLIENT_TOKENIZER_JSON_H_
#define TALLY_CLIENT_TOKENIZER_JSON_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "nlohmann/json.hpp"

namespace tally {

// One step of a tokenizer.json "decoder": maps the tokens (or what the
// previous step made of them) to new strings; Decode joins the last step's.
class TokenDecoder {
 public:
  virtual ~TokenDecoder() = default;
  virtual std::vector<std::string> DecodeChain(
      std::vector<std::string> tokens) const = 0;
};

// The decoder a tokenizer.json "decoder" value describes (null: none, so
// nullptr). INVALID_ARGUMENT naming `where` and the field for a type not
// listed above or a malformed field.
absl::StatusOr<std::unique_ptr<TokenDecoder>> MakeTokenDecoder(
    const nlohmann::json& decoder, const std::string& where);

// `bytes` as UTF-8 text: each maximal invalid subsequence becomes U+FFFD.
std::string Utf8Lossy(absl::string_view bytes);

class TokenizerJson {
 public:
  // DIR/tokenizer.json. The file's errno code when it cannot be read
  // (NOT_FOUND when missing); INVALID_ARGUMENT naming the file and field
  // for anything it cannot use.
  static absl::StatusOr<TokenizerJson> Load(const std::string& dir);
  // The parsed contents of a tokenizer.json; `where` names it in errors.
  static absl::StatusOr<TokenizerJson> FromJson(const nlohmann::json& json,
                                                const std::string& where);

  // The text of `ids`; with `skip_special_tokens` the added tokens marked
  // "special" are left out. INVALID_ARGUMENT naming the first id that has
  // no token.
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     bool skip_special_tokens) const;

  // One more than the largest id with a token.
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  struct Token {
    std::string content;
    bool present = false;
    bool special = false;
  };

  std::string where_;
  std::vector<Token> tokens_;                    // by id
  std::shared_ptr<const TokenDecoder> decoder_;  // null: join with spaces
};

}  // namespace tally

#endif  // TALLY_CLIENT_TOKENIZER_JSON_H_
