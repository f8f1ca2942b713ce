// The bounded JSON reader (base/json_reader.h) every file a client can point
// the server at goes through: nesting and size limits measured before
// parsing, errors that name the file and where, and quote only short
// prefixes of what they refuse.
#include "base/json_reader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "base/file_text.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

using ::testing::HasSubstr;

// Longer than any message the reader writes for a short file name.
constexpr size_t kShortMessage = 400;

std::string Nested(const std::string& head, const std::string& tail,
                   size_t depth) {
  return head + std::string(depth, '[') + std::string(depth, ']') + tail;
}

class JsonReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::path(::testing::TempDir()) / "json_reader_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  std::string dir_;
};

TEST_F(JsonReaderTest, DeepNestingIsRefusedNamingTheFileAndWhere) {
  const std::string deep = Nested(R"({"weight_map":{"a":)", "}}", 100000);
  const absl::StatusOr<nlohmann::json> parsed =
      ParseJson(deep, kShardIndexJsonLimits, "model.safetensors.index.json",
                absl::StatusCode::kDataLoss);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("model.safetensors.index.json nests arrays and "
                        "objects deeper than 64 levels (at weight_map.a[][]"));
  EXPECT_LE(parsed.status().message().size(), kShortMessage);
}

TEST_F(JsonReaderTest, NestingUpToTheLimitParses) {
  const JsonLimits limits = {1 << 20, 8};
  // The outer object is level 1: seven arrays inside it reach 8.
  EXPECT_TRUE(ParseJson(Nested(R"({"a":)", "}", 7), limits, "f",
                        absl::StatusCode::kDataLoss)
                  .ok());
  const absl::StatusOr<nlohmann::json> deeper =
      ParseJson(Nested(R"({"a":)", "}", 8), limits, "f",
                absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(deeper.status().code(), absl::StatusCode::kInvalidArgument);
  // Brackets inside strings are text, escaped quotes included.
  const std::string in_string =
      R"({"a\"[[[": ")" + std::string(100, '[') + R"(\"{{{{"})";
  const absl::StatusOr<nlohmann::json> text =
      ParseJson(in_string, limits, "f", absl::StatusCode::kDataLoss);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ((*text)["a\"[[["], std::string(100, '[') + "\"{{{{");
}

TEST_F(JsonReaderTest, OversizedTextIsRefused) {
  const JsonLimits limits = {16, kMaxJsonDepth};
  const absl::StatusOr<nlohmann::json> parsed =
      ParseJson(R"({"a": "0123456789"})", limits, "config.json",
                absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("config.json is 19 bytes, more than the 16-byte"));
}

TEST_F(JsonReaderTest, SyntaxErrorsQuoteNoValue) {
  // An unterminated string of 100000 characters: nlohmann's own message
  // would quote all of it.
  const std::string text = R"({"a": ")" + std::string(100000, 'x');
  const absl::StatusOr<nlohmann::json> parsed = ParseJson(
      text, kConfigJsonLimits, "config.json", absl::StatusCode::kDataLoss);
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("config.json is not valid JSON (at byte"));
  EXPECT_LE(parsed.status().message().size(), kShortMessage);
}

TEST_F(JsonReaderTest, ExcerptsAreShort) {
  EXPECT_EQ(Excerpt("short"), "short");
  const std::string excerpt = Excerpt(std::string(1000, 'y'));
  EXPECT_EQ(excerpt, std::string(kMaxExcerptChars, 'y') + "... (1000 bytes)");
  nlohmann::json long_array = nlohmann::json::array();
  for (int i = 0; i < 1000; ++i) long_array.push_back(i);
  EXPECT_LE(JsonExcerpt(long_array).size(), kMaxExcerptChars + 32);
}

TEST_F(JsonReaderTest, ReadsFilesWithinTheirLimits) {
  const std::string path = Write("tally.json", R"({"step": 3})");
  const absl::StatusOr<nlohmann::ordered_json> read =
      ReadJsonFile<nlohmann::ordered_json>(path, kConfigJsonLimits,
                                           absl::StatusCode::kDataLoss);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)["step"], 3);

  EXPECT_EQ(ReadJsonFile(dir_ + "/absent.json", kConfigJsonLimits,
                         absl::StatusCode::kDataLoss)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST_F(JsonReaderTest, OversizedFilesAreRefusedUnread) {
  // Sparse: 8 GiB of nothing, refused from its size alone.
  const std::string path = Write("model.safetensors.index.json", "");
  ASSERT_EQ(::truncate(path.c_str(), int64_t{8} << 30), 0);
  const absl::Status status =
      ReadJsonFile(path, kShardIndexJsonLimits, absl::StatusCode::kDataLoss)
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr(path + " is 8589934592 bytes"));
}

TEST_F(JsonReaderTest, FilesThatAreNotRegularAreRefusedWithoutBlocking) {
  // A device without end, and a FIFO no one writes to: opening the FIFO
  // for reading would block forever.
  const std::string fifo = dir_ + "/config.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {std::string("/dev/zero"), fifo, dir_}) {
    const absl::StatusOr<std::string> read =
        ReadFileUpTo(path, 1 << 16, absl::StatusCode::kDataLoss);
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << path;
    EXPECT_THAT(read.status().message(),
                HasSubstr(path + " is not a regular file"));
  }
}

}  // namespace
}  // namespace tally
