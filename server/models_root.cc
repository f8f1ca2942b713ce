#include "server/models_root.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "base/file_text.h"
#include "server/path_confinement.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

constexpr char kHubPrefix[] = "models--";

bool IsNamePart(absl::string_view part) {
  if (part.empty() || part.front() == '.') return false;
  return std::all_of(part.begin(), part.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
           c == '_' || c == '-';
  });
}

// "Org/Name" or "Name" split into its parts; empty when not a model name.
std::vector<std::string> NameParts(const std::string& name) {
  std::vector<std::string> parts = absl::StrSplit(name, '/');
  if (parts.size() > 2 || !std::all_of(parts.begin(), parts.end(), IsNamePart))
    return {};
  return parts;
}

bool HasConfig(const fs::path& dir) {
  std::error_code error;
  return fs::is_regular_file(dir / "config.json", error);
}

// The snapshot directory of a hub-cache entry; nullopt when it has none.
absl::StatusOr<std::optional<fs::path>> HubSnapshot(const fs::path& entry,
                                                    const std::string& name) {
  std::error_code error;
  const fs::path snapshots = entry / "snapshots";
  if (!fs::is_directory(snapshots, error)) return std::nullopt;
  absl::StatusOr<std::string> ref =
      ReadFileUpTo((entry / "refs" / "main").string(), 256);
  if (ref.ok()) {
    const std::string rev(absl::StripAsciiWhitespace(*ref));
    if (!IsNamePart(rev) || !fs::is_directory(snapshots / rev, error)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the models root's ", name, " has a refs/main naming no snapshot"));
    }
    return snapshots / rev;
  }
  std::vector<fs::path> found;
  for (fs::directory_iterator it(snapshots, error), end; !error && it != end;
       it.increment(error)) {
    if (it->is_directory()) found.push_back(it->path());
  }
  if (found.empty()) return std::nullopt;
  if (found.size() > 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("the models root holds ", found.size(), " snapshots of ",
                     name, " and no refs/main saying which to use"));
  }
  return found.front();
}

}  // namespace

absl::StatusOr<std::optional<std::string>> ResolveModelName(
    const std::string& root, const std::string& name) {
  const std::vector<std::string> parts = NameParts(name);
  if (parts.empty()) return std::nullopt;
  std::optional<fs::path> dir;
  const fs::path entry =
      fs::path(root) / absl::StrCat(kHubPrefix, absl::StrJoin(parts, "--"));
  absl::StatusOr<std::optional<fs::path>> snapshot = HubSnapshot(entry, name);
  if (!snapshot.ok()) return snapshot.status();
  if (snapshot->has_value()) {
    dir = **snapshot;
  } else if (HasConfig(fs::path(root) / name)) {
    dir = fs::path(root) / name;
  }
  if (!dir.has_value()) return std::nullopt;
  absl::StatusOr<std::string> confined =
      ConfineToRoot(root, fs::path(*dir).lexically_relative(root).string());
  if (!confined.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init_checkpoint ", name, " resolves outside --models-root"));
  }
  return *confined;
}

std::vector<std::string> ListModelNames(const std::string& root) {
  std::vector<std::string> names;
  std::error_code error;
  for (fs::directory_iterator it(root, error), end; !error && it != end;
       it.increment(error)) {
    const std::string entry = it->path().filename().string();
    if (absl::StartsWith(entry, kHubPrefix)) {
      // models--Org--Name: names hold no "--" of their own in practice.
      const std::string name = absl::StrReplaceAll(
          entry.substr(sizeof(kHubPrefix) - 1), {{"--", "/"}});
      absl::StatusOr<std::optional<std::string>> dir =
          ResolveModelName(root, name);
      if (dir.ok() && dir->has_value()) names.push_back(name);
      continue;
    }
    if (!IsNamePart(entry) || !it->is_directory()) continue;
    if (HasConfig(it->path())) {
      names.push_back(entry);
      continue;
    }
    std::error_code inner;
    for (fs::directory_iterator model(it->path(), inner), done;
         !inner && model != done; model.increment(inner)) {
      const std::string part = model->path().filename().string();
      if (IsNamePart(part) && HasConfig(model->path())) {
        names.push_back(absl::StrCat(entry, "/", part));
      }
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

}  // namespace tally
