#include "server/path_confinement.h"

#include <algorithm>
#include <filesystem>
#include <iterator>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tally {

namespace fs = std::filesystem;

absl::StatusOr<std::string> ConfineToRoot(const std::string& root,
                                          const std::string& path) {
  std::error_code error;
  const fs::path real_root = fs::canonical(root, error);
  if (error) {
    return absl::ErrnoToStatus(error.value(),
                               absl::StrCat("checkpoint root ", root));
  }
  // The OS would end the path at a NUL, so what was checked is not what
  // would be opened (an "x\0" below the root names the root itself).
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        "checkpoint path may not contain NUL bytes");
  }
  const fs::path requested(path);
  for (const fs::path& part : requested) {
    if (part == "..") {
      return absl::PermissionDeniedError(
          absl::StrCat("checkpoint path ", path, " may not contain '..'"));
    }
  }
  const fs::path resolved = fs::weakly_canonical(
      requested.is_absolute() ? requested : real_root / requested, error);
  if (error) {
    return absl::ErrnoToStatus(error.value(), absl::StrCat("resolve ", path));
  }
  // Strictly inside: the root itself is not a checkpoint.
  const auto [root_end, unused] = std::mismatch(
      real_root.begin(), real_root.end(), resolved.begin(), resolved.end());
  if (root_end != real_root.end() ||
      std::distance(real_root.begin(), real_root.end()) >=
          std::distance(resolved.begin(), resolved.end())) {
    return absl::PermissionDeniedError(absl::StrCat(
        "checkpoint path ", path, " resolves to ", resolved.string(),
        ", outside the checkpoint root ", real_root.string()));
  }
  // weakly_canonical resolved every symlink with an existing target, so one
  // left below the root dangles (or loops): it may point anywhere, and
  // creating the path would create its target.
  fs::path prefix = real_root;
  auto part = resolved.begin();
  std::advance(part, std::distance(real_root.begin(), real_root.end()));
  for (; part != resolved.end(); ++part) {
    if (part->empty()) continue;  // a trailing separator
    prefix /= *part;
    if (fs::is_symlink(fs::symlink_status(prefix, error))) {
      return absl::PermissionDeniedError(
          absl::StrCat("checkpoint path ", path, " goes through ",
                       prefix.string(), ", a symlink to a missing target"));
    }
  }
  return resolved.string();
}

}  // namespace tally
