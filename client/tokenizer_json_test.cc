// TokenizerJson decodes ids as HF's tokenizer.json decoders do: small files
// written here in the published format, each expected text worked out by
// hand from the vocabulary (the byte-level alphabet maps printable Latin-1
// bytes to themselves and the others, in byte order, to U+0100 onwards).
#include "client/tokenizer_json.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tally {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr char kFffd[] = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

// A GPT-2 style byte-level tokenizer. "Ġ" is U+0120: space (byte 32) is the
// 33rd byte outside the printable ranges. "Ċ" (U+010A) is byte 10. "Ã©" is
// bytes C3 A9 (é). "Ń" (U+0143) is byte AD: 33 control bytes, 34 of
// 7F..A0, then AD is the 68th.
constexpr char kByteLevel[] = R"({
  "version": "1.0",
  "added_tokens": [
    {"id": 7, "content": "<|endoftext|>", "single_word": false,
     "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 8, "content": "<tool>", "special": false},
    {"id": 10, "content": "日", "special": false}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                    "trim_offsets": true, "use_regex": true},
  "post_processor": null,
  "decoder": {"type": "ByteLevel", "add_prefix_space": true,
              "trim_offsets": true, "use_regex": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "vocab": {"H": 0, "ello": 1, "Ġworld": 2, "Ċ": 3, "Ã©": 4,
                      "Ã": 5, "©": 6, "Â": 9, "Ń": 11},
            "merges": ["e l", "el lo"]}
})";

// Llama 2's decoder over a byte-fallback SentencePiece BPE vocabulary.
constexpr char kLlama2[] = R"({
  "added_tokens": [
    {"id": 0, "content": "<unk>", "special": true},
    {"id": 1, "content": "<s>", "special": true},
    {"id": 2, "content": "</s>", "special": true}
  ],
  "decoder": {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}
  ]},
  "model": {"type": "BPE", "byte_fallback": true,
            "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3,
                      "<0xE2>": 4, "<0x82>": 5, "<0xAC>": 6, "▁Hello": 7,
                      "▁world": 8, "!": 9, "▁▁": 10},
            "merges": []}
})";

class TokenizerJsonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           absl::StrCat(
               "tokenizer_json_test_", getpid(), "_",
               ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  absl::StatusOr<TokenizerJson> LoadText(const std::string& text) {
    std::ofstream(dir_ / "tokenizer.json") << text;
    return TokenizerJson::Load(dir_.string());
  }

  // The text of `ids` through `json`, or the error's message.
  std::string DecodeWith(const std::string& json, std::vector<int32_t> ids,
                         bool skip_special = false) {
    absl::StatusOr<TokenizerJson> tokenizer = LoadText(json);
    if (!tokenizer.ok()) return tokenizer.status().ToString();
    absl::StatusOr<std::string> text = tokenizer->Decode(ids, skip_special);
    return text.ok() ? *text : text.status().ToString();
  }

  fs::path dir_;
};

TEST_F(TokenizerJsonTest, ByteLevelMapsTheAlphabetBackToBytes) {
  EXPECT_EQ(DecodeWith(kByteLevel, {0, 1, 2, 3}), "Hello world\n");
  EXPECT_EQ(DecodeWith(kByteLevel, {0, 4}), "H\xC3\xA9");
  // é cut between two tokens joins again.
  EXPECT_EQ(DecodeWith(kByteLevel, {5, 6}), "\xC3\xA9");
  EXPECT_EQ(DecodeWith(kByteLevel, {9, 11}), "\xC2\xAD");  // U+00AD
}

TEST_F(TokenizerJsonTest, ByteLevelReplacesBytesThatAreNotUtf8) {
  EXPECT_EQ(DecodeWith(kByteLevel, {5, 0}), absl::StrCat(kFffd, "H"));
  EXPECT_EQ(DecodeWith(kByteLevel, {0, 6, 6}), absl::StrCat("H", kFffd, kFffd));
  EXPECT_EQ(DecodeWith(kByteLevel, {11}), kFffd);
}

TEST_F(TokenizerJsonTest, AddedTokensPrintTheirContent) {
  EXPECT_EQ(DecodeWith(kByteLevel, {0, 7, 1, 8}), "H<|endoftext|>ello<tool>");
  EXPECT_EQ(DecodeWith(kByteLevel, {0, 7, 1, 8}, /*skip_special=*/true),
            "Hello<tool>");
  // Content outside the byte-level alphabet passes as it is.
  EXPECT_EQ(DecodeWith(kByteLevel, {0, 10}), "H\xE6\x97\xA5");
}

TEST_F(TokenizerJsonTest, Llama2SequenceDecodesSpacesAndByteFallback) {
  EXPECT_EQ(DecodeWith(kLlama2, {1, 7, 8, 9, 3}, /*skip_special=*/true),
            "Hello world!\n");
  EXPECT_EQ(DecodeWith(kLlama2, {1, 7, 8, 9}), "<s> Hello world!");
  EXPECT_EQ(DecodeWith(kLlama2, {7, 4, 5, 6}), "Hello\xE2\x82\xAC");  // €
  // A cut character: one U+FFFD per byte, as ByteFallback does.
  EXPECT_EQ(DecodeWith(kLlama2, {7, 4, 5}),
            absl::StrCat("Hello", kFffd, kFffd));
  // Strip drops one leading space only.
  EXPECT_EQ(DecodeWith(kLlama2, {10, 7}), "  Hello");
}

TEST_F(TokenizerJsonTest, MetaspaceDropsTheFirstSpaceUnlessNever) {
  const std::string vocab =
      R"("model": {"type": "Unigram", "vocab": [["▁Hello", -1.0],
          ["▁world", -2.0], ["▁", -3.0]]})";
  const auto file = [&](const std::string& decoder) {
    return absl::StrCat("{\"decoder\": ", decoder, ", ", vocab, "}");
  };
  EXPECT_EQ(DecodeWith(file(R"({"type": "Metaspace", "replacement": "▁",
                                "prepend_scheme": "always", "split": false})"),
                       {0, 1}),
            "Hello world");
  EXPECT_EQ(DecodeWith(file(R"({"type": "Metaspace", "replacement": "▁",
                                "prepend_scheme": "never"})"),
                       {0, 2, 1}),
            " Hello  world");
  EXPECT_EQ(DecodeWith(file(R"({"type": "Metaspace", "replacement": "▁",
                                "add_prefix_space": true})"),
                       {0, 1}),
            "Hello world");
}

TEST_F(TokenizerJsonTest, NoDecoderJoinsTokensWithSpaces) {
  EXPECT_EQ(DecodeWith(R"({"decoder": null, "model": {"type": "WordLevel",
                           "vocab": {"a": 0, "b": 1}}})",
                       {0, 1, 0}),
            "a b a");
}

TEST_F(TokenizerJsonTest, BadFilesAndIdsGetErrorsNamingTheProblem) {
  const absl::StatusOr<TokenizerJson> missing =
      TokenizerJson::Load((dir_ / "absent").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("absent/tokenizer.json"));

  const absl::StatusOr<TokenizerJson> not_json = LoadText("{\"model\": ");
  EXPECT_EQ(not_json.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(not_json.status().message(), HasSubstr("tokenizer.json"));

  EXPECT_THAT(DecodeWith(kByteLevel, {0, 12}),
              HasSubstr("token id 12 has no token in"));
  EXPECT_THAT(DecodeWith(kByteLevel, {-1}), HasSubstr("token id -1"));
  EXPECT_THAT(DecodeWith(R"({"model": {"vocab": {"a": 0}}})", {1}),
              HasSubstr("token id 1 has no token"));
  EXPECT_THAT(DecodeWith(R"({"model": {"type": "BPE"}})", {0}),
              HasSubstr("model.vocab is missing"));
  EXPECT_THAT(DecodeWith(R"({"model": {"vocab": {"a": -4}}})", {0}),
              HasSubstr("model.vocab[\"a\"] is not a token id"));
  EXPECT_THAT(DecodeWith(R"({"model": {"vocab": {"a": 99999999999}}})", {0}),
              HasSubstr("is not a token id in [0, 16777216)"));
  EXPECT_THAT(
      DecodeWith(R"({"added_tokens": [{"id": 1}], "model": {"vocab": {}}})",
                 {0}),
      HasSubstr("added_tokens[0] is not an object with an id and a content"));
}

TEST_F(TokenizerJsonTest, UnknownDecodersAreRefusedByName) {
  const std::string vocab = R"("model": {"vocab": {"a": 0}})";
  EXPECT_THAT(
      DecodeWith(absl::StrCat(R"({"decoder": {"type": "CTC"}, )", vocab, "}"),
                 {0}),
      HasSubstr("decoder.type 'CTC' is not a decoder tallyctl reads"));
  EXPECT_THAT(
      DecodeWith(absl::StrCat(R"({"decoder": {"type": "Sequence", "decoders":
                                  [{"type": "Fuse"}, {"type": "WordPiece"}]}, )",
                              vocab, "}"),
                 {0}),
      HasSubstr("decoder.decoders[1].type 'WordPiece'"));
  EXPECT_THAT(
      DecodeWith(absl::StrCat(R"({"decoder": {"type": "Replace", "pattern":
                                  {"Regex": " +"}, "content": " "}, )",
                              vocab, "}"),
                 {0}),
      HasSubstr("decoder.pattern is not {\"String\""));
  EXPECT_THAT(DecodeWith(absl::StrCat(R"({"decoder": {"type": "Metaspace",
                                          "replacement": "ab"}, )",
                                      vocab, "}"),
                         {0}),
              HasSubstr("decoder.replacement is not one character"));
}

TEST(Utf8LossyTest, ReplacesEachMaximalInvalidSubpart) {
  EXPECT_EQ(Utf8Lossy("ok \xC3\xA9"), "ok \xC3\xA9");
  EXPECT_EQ(Utf8Lossy("\xF0\x9F\x98"), kFffd);  // a cut 4-byte character
  EXPECT_EQ(Utf8Lossy("\xE2\x82x"), absl::StrCat(kFffd, "x"));
  EXPECT_EQ(Utf8Lossy("\xC0\xAF"), absl::StrCat(kFffd, kFffd));  // overlong
  EXPECT_EQ(Utf8Lossy("\xED\xA0\x80"),                           // a surrogate
            absl::StrCat(kFffd, kFffd, kFffd));
  EXPECT_EQ(Utf8Lossy("\xFF"), kFffd);
}

}  // namespace
}  // namespace tally
