// libFuzzer target: client checkpoint paths through ConfineToRoot
// (server/path_confinement.h) against a fixed directory tree with symlinks
// that stay inside the root, lead out of it, dangle, loop, and a sibling
// whose name extends the root's. Whatever is accepted must stay inside:
//   - lexically: an absolute path strictly below the real root, with no "."
//     or ".." component and no NUL byte (the OS would cut the path there);
//   - on disk: no component below the root is a symlink (every existing one
//     was resolved, so a remaining one dangles and could lead anywhere once
//     its target appears), and confining the result again gives it back.
// The first input byte picks how the path starts (relative, under the real
// root, under a symlinked spelling of the root, under the tree's base); the
// rest is the path.
//
//   build/tests/fuzz/fuzzers-build/path_confinement_fuzzer -runs=20000
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "absl/status/statusor.h"
#include "server/path_confinement.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

void Require(bool invariant) {
  if (!invariant) abort();
}

struct Tree {
  std::string base;       // holds root/, outside/, root-sibling/, rootlink
  std::string root;       // the checkpoint root as configured
  std::string real_root;  // canonical
  std::string root_link;  // a symlink spelling of the root
};

// <base>/root/{inside/, file, alias -> inside, self -> ., up -> ..,
//              escape -> <base>/outside, dangling -> <base>/outside/missing,
//              loop -> loop}
// <base>/outside/, <base>/root-sibling/, <base>/rootlink -> root
Tree MakeTree() {
  char pattern[] = "/tmp/tally_path_fuzz_XXXXXX";
  Require(mkdtemp(pattern) != nullptr);
  Tree tree;
  tree.base = fs::canonical(pattern).string();
  tree.root = tree.base + "/root";
  tree.root_link = tree.base + "/rootlink";
  fs::create_directories(tree.root + "/inside");
  fs::create_directories(tree.base + "/outside");
  fs::create_directories(tree.base + "/root-sibling");
  std::FILE* file = std::fopen((tree.root + "/file").c_str(), "w");
  Require(file != nullptr);
  std::fclose(file);
  fs::create_directory_symlink("inside", tree.root + "/alias");
  fs::create_directory_symlink(".", tree.root + "/self");
  fs::create_directory_symlink("..", tree.root + "/up");
  fs::create_directory_symlink(tree.base + "/outside", tree.root + "/escape");
  fs::create_symlink(tree.base + "/outside/missing", tree.root + "/dangling");
  fs::create_symlink("loop", tree.root + "/loop");
  fs::create_directory_symlink("root", tree.root_link);
  tree.real_root = fs::canonical(tree.root).string();
  return tree;
}

// Built on first use, removed when the fuzzer exits normally (a crash
// leaves it for inspection).
const Tree& SharedTree() {
  static const Tree* tree = [] {
    const Tree* made = new Tree(MakeTree());
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(SharedTree().base, ignored);
    });
    return made;
  }();
  return *tree;
}

void CheckAccepted(const Tree& tree, const std::string& result) {
  Require(result.find('\0') == std::string::npos);
  const fs::path path(result);
  Require(path.is_absolute());
  for (const fs::path& part : path) Require(part != "." && part != "..");
  const fs::path relative = path.lexically_relative(tree.real_root);
  Require(!relative.empty() && relative != "." && *relative.begin() != "..");
  // Every component below the root: never a symlink.
  fs::path prefix(tree.real_root);
  for (const fs::path& part : relative) {
    if (part.empty()) continue;  // a trailing separator
    prefix /= part;
    std::error_code error;
    const fs::file_status status = fs::symlink_status(prefix, error);
    Require(status.type() != fs::file_type::symlink);
  }
  absl::StatusOr<std::string> again = ConfineToRoot(tree.root, result);
  Require(again.ok() && *again == result);
}

}  // namespace
}  // namespace tally

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tally;
  if (size == 0) return 0;
  const Tree& tree = SharedTree();
  std::string path;
  switch (data[0] % 4) {
    case 1:
      path = tree.real_root + "/";
      break;
    case 2:
      path = tree.root_link + "/";
      break;
    case 3:
      path = tree.base + "/";
      break;
    default:
      break;
  }
  path.append(reinterpret_cast<const char*>(data + 1), size - 1);
  absl::StatusOr<std::string> result = ConfineToRoot(tree.root, path);
  if (result.ok()) CheckAccepted(tree, *result);
  return 0;
}
