// ReadEosTokenIds: generation_config.json first, then config.json; an int or
// a list; refusals naming the file and the field.
#include "runtime/config/generation_config.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"

namespace tally {
namespace {

class GenerationConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        (std::filesystem::path(::testing::TempDir()) / "gen_XXXXXX").string();
    ASSERT_NE(mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& file, const std::string& text) {
    std::ofstream(dir_ + "/" + file) << text;
  }

  std::string dir_;
};

using Ids = std::vector<int64_t>;

TEST_F(GenerationConfigTest, NoFileOrNoFieldMeansNoEos) {
  EXPECT_EQ(ReadEosTokenIds("").value(), Ids());
  EXPECT_EQ(ReadEosTokenIds(dir_).value(), Ids());
  Write("config.json", R"({"vocab_size": 8, "eos_token_id": null})");
  EXPECT_EQ(ReadEosTokenIds(dir_).value(), Ids());
}

TEST_F(GenerationConfigTest, GenerationConfigComesBeforeConfig) {
  Write("config.json", R"({"eos_token_id": 2})");
  EXPECT_EQ(ReadEosTokenIds(dir_).value(), Ids{2});
  Write("generation_config.json", R"({"do_sample": true})");
  EXPECT_EQ(ReadEosTokenIds(dir_).value(), Ids{2});
  Write("generation_config.json", R"({"eos_token_id": [5, 7]})");
  EXPECT_EQ(ReadEosTokenIds(dir_).value(), (Ids{5, 7}));
}

TEST_F(GenerationConfigTest, RefusesAWrongTypeNamingFileAndField) {
  for (const char* bad : {R"({"eos_token_id": "2"})", R"({"eos_token_id": -1})",
                          R"({"eos_token_id": [1, 2.5]})", R"([2])"}) {
    Write("generation_config.json", bad);
    const absl::Status status = ReadEosTokenIds(dir_).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(status.message(), "generation_config.json"))
        << status;
    if (absl::StrContains(bad, "eos_token_id")) {
      EXPECT_TRUE(absl::StrContains(status.message(), "eos_token_id"))
          << status;
    }
  }
}

}  // namespace
}  // namespace tally
