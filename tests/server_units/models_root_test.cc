#include "server/models_root.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace tally {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;

void WriteModelFile(const fs::path& path, const std::string& data) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::trunc) << data;
}

class ModelsRootTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ =
        fs::temp_directory_path() /
        absl::StrCat(
            "models_root_test_", getpid(), "_",
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "models");
    models_ = (root_ / "models").string();
  }
  void TearDown() override { fs::remove_all(root_); }

  std::optional<std::string> Resolve(const std::string& name) {
    absl::StatusOr<std::optional<std::string>> dir =
        ResolveModelName(models_, name);
    EXPECT_TRUE(dir.ok()) << dir.status();
    return dir.value_or(std::nullopt);
  }

  fs::path root_;
  std::string models_;
};

TEST_F(ModelsRootTest, HubCacheUsesRefsMain) {
  const fs::path entry = root_ / "models/models--Qwen--Qwen3-8B";
  WriteModelFile(entry / "snapshots/aaa/config.json", "{}");
  WriteModelFile(entry / "snapshots/bbb/config.json", "{}");
  WriteModelFile(entry / "refs/main", "bbb\n");
  EXPECT_EQ(Resolve("Qwen/Qwen3-8B"),
            fs::canonical(entry / "snapshots/bbb").string());
}

TEST_F(ModelsRootTest, HubCacheWithOneSnapshotNeedsNoRef) {
  const fs::path entry = root_ / "models/models--Org--M";
  WriteModelFile(entry / "snapshots/only/config.json", "{}");
  EXPECT_EQ(Resolve("Org/M"), fs::canonical(entry / "snapshots/only").string());
}

TEST_F(ModelsRootTest, SeveralSnapshotsWithoutRefOrABadRefAreRefused) {
  const fs::path entry = root_ / "models/models--Org--M";
  WriteModelFile(entry / "snapshots/a/config.json", "{}");
  WriteModelFile(entry / "snapshots/b/config.json", "{}");
  EXPECT_EQ(ResolveModelName(models_, "Org/M").status().code(),
            absl::StatusCode::kFailedPrecondition);
  WriteModelFile(entry / "refs/main", "../../../etc");
  EXPECT_EQ(ResolveModelName(models_, "Org/M").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ModelsRootTest, PlainFolders) {
  WriteModelFile(root_ / "models/meta/Llama-1B/config.json", "{}");
  WriteModelFile(root_ / "models/tiny/config.json", "{}");
  EXPECT_EQ(Resolve("meta/Llama-1B"),
            fs::canonical(root_ / "models/meta/Llama-1B").string());
  EXPECT_EQ(Resolve("tiny"), fs::canonical(root_ / "models/tiny").string());
  EXPECT_EQ(Resolve("meta/Missing"), std::nullopt);
}

TEST_F(ModelsRootTest, NamesCannotEscapeTheRoot) {
  WriteModelFile(root_ / "outside/config.json", "{}");
  WriteModelFile(root_ / "models/org/config.json", "{}");
  for (const char* name :
       {"../outside", "org/..", "/abs/path", "./org", "a/b/c", ".hidden", ""}) {
    EXPECT_EQ(Resolve(name), std::nullopt) << name;
  }
  fs::create_directories(root_ / "models/evil");
  fs::create_directory_symlink(root_ / "outside", root_ / "models/evil/link");
  EXPECT_EQ(ResolveModelName(models_, "evil/link").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelsRootTest, ListsBothLayouts) {
  WriteModelFile(
      root_ / "models/models--Qwen--Qwen3-8B/snapshots/r/config.json", "{}");
  WriteModelFile(root_ / "models/models--Org--Empty/refs/main", "x");
  WriteModelFile(root_ / "models/meta/Llama-1B/config.json", "{}");
  WriteModelFile(root_ / "models/tiny/config.json", "{}");
  WriteModelFile(root_ / "models/notes/readme.txt", "");
  EXPECT_THAT(ListModelNames(models_),
              ElementsAre("Qwen/Qwen3-8B", "meta/Llama-1B", "tiny"));
}

}  // namespace
}  // namespace tally
