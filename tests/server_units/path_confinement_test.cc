// ConfineToRoot on a real directory tree: relative and absolute paths inside
// the root resolve below it (through symlinks that stay inside); "..",
// symlinks that lead out, the root itself and absolute paths elsewhere are
// PERMISSION_DENIED, and so are dangling symlinks; a NUL is
// INVALID_ARGUMENT. tests/fuzz/path_confinement_fuzzer.cc explores the rest.
#include "server/path_confinement.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

class PathConfinementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/confine-", getpid());
    fs::remove_all(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  std::string PathOf(const std::string& name) const {
    return dir_ + "/" + name;
  }

  std::string dir_;
};

TEST_F(PathConfinementTest, KeepsPathsInsideAndRejectsEscapes) {
  const std::string root = PathOf("root");
  fs::create_directories(root + "/inside");
  fs::create_directories(PathOf("outside"));
  fs::create_directory_symlink(PathOf("outside"), root + "/escape");
  fs::create_directory_symlink(root + "/inside", root + "/alias");
  const std::string real_root = fs::canonical(root).string();

  EXPECT_EQ(ConfineToRoot(root, "a/b").value_or(""), real_root + "/a/b");
  EXPECT_EQ(ConfineToRoot(root, root + "/inside/c").value_or(""),
            real_root + "/inside/c");
  EXPECT_EQ(ConfineToRoot(root, "alias/c").value_or(""),
            real_root + "/inside/c");
  for (const std::string& bad :
       {std::string("../outside/c"), std::string("inside/../../outside"),
        std::string("a/.."), root + "/../outside/c", PathOf("outside/c"),
        std::string("escape/c"), root + "/escape", std::string("/etc/x"), root,
        std::string(".")}) {
    SCOPED_TRACE(bad);
    EXPECT_EQ(ConfineToRoot(root, bad).status().code(),
              absl::StatusCode::kPermissionDenied);
  }
}

// Two escapes the fuzzer found: a NUL cuts the path where the OS reads it
// (so "x\0" below the root names the root), and a dangling symlink would
// create its target, outside the root, on the first write.
TEST_F(PathConfinementTest, RefusesANulAndADanglingSymlink) {
  const std::string root = PathOf("root");
  fs::create_directories(root);
  fs::create_directory_symlink(PathOf("outside/missing"), root + "/dangling");
  EXPECT_EQ(ConfineToRoot(root, std::string("x\0", 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const std::string& bad :
       {std::string("dangling"), std::string("dangling/run")}) {
    SCOPED_TRACE(bad);
    EXPECT_EQ(ConfineToRoot(root, bad).status().code(),
              absl::StatusCode::kPermissionDenied);
  }
  EXPECT_FALSE(fs::exists(PathOf("outside")));
}

}  // namespace
}  // namespace tally
