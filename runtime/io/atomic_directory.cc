#include "runtime/io/atomic_directory.h"

#include <fcntl.h>  // AT_FDCWD
#include <stdio.h>  // renameat2, RENAME_EXCHANGE
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status.h"
#include "runtime/io/safetensors.h"

namespace tally {

namespace fs = std::filesystem;

namespace {

absl::Status ErrorCodeStatus(const std::error_code& error,
                             absl::string_view what) {
  return absl::ErrnoToStatus(error.value(), what);
}

PublishTestHooks& TestHooks() {
  static PublishTestHooks* hooks = new PublishTestHooks();
  return *hooks;
}

absl::Status ReachedStage(absl::string_view stage) {
  const PublishTestHooks& hooks = TestHooks();
  return hooks.at_stage ? hooks.at_stage(stage) : absl::OkStatus();
}

// Sibling names of `<parent>/<name>`: hidden, so directory listings and the
// step-checkpoint scan skip them.
std::string StagingPrefix(const std::string& name) {
  return absl::StrCat(".", name, ".staging-");
}
std::string PreviousName(const std::string& name) {
  return absl::StrCat(".", name, ".previous");
}

// renameat2(RENAME_EXCHANGE): both paths exist before and after, swapped in
// one step. EINVAL / ENOSYS / ENOTSUP when the filesystem cannot.
int ExchangePaths(const std::string& a, const std::string& b) {
  return ::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE);
}

// Moves the complete `staging` directory to `target`, replacing a checkpoint
// there. Until the commit point `target` holds the previous checkpoint (or,
// in the fallback's window between its two renames, nothing, with the
// previous one at `previous`, where PublishedDir finds it).
absl::Status Publish(const fs::path& staging, const fs::path& target) {
  const std::string parent = target.parent_path().string();
  const fs::path previous =
      target.parent_path() / PreviousName(target.filename().string());
  std::error_code error;
  const bool replacing = fs::exists(target, error);
  if (replacing && TestHooks().use_rename_exchange &&
      ExchangePaths(staging.string(), target.string()) == 0) {
    // `staging` now holds the previous checkpoint.
    TALLY_RETURN_IF_ERROR(ReachedStage("exchanged"));
    TALLY_RETURN_IF_ERROR(SyncDirectory(parent));
    TALLY_RETURN_IF_ERROR(ReachedStage("published"));
    fs::remove_all(staging, error);
    if (error) return ErrorCodeStatus(error, "remove previous checkpoint");
    return ReachedStage("removed previous");
  }
  if (replacing) {
    if (::rename(target.c_str(), previous.c_str()) != 0) {
      return absl::ErrnoToStatus(
          errno, absl::StrCat("rename ", target.string(), " aside"));
    }
    absl::Status aside = SyncDirectory(parent);
    if (aside.ok()) aside = ReachedStage("moved previous aside");
    if (!aside.ok()) {
      ::rename(previous.c_str(), target.c_str());  // best effort: undo
      return aside;
    }
  }
  if (::rename(staging.c_str(), target.c_str()) != 0) {
    const absl::Status status = absl::ErrnoToStatus(
        errno,
        absl::StrCat("rename ", staging.string(), " to ", target.string()));
    if (replacing) ::rename(previous.c_str(), target.c_str());  // undo
    return status;
  }
  TALLY_RETURN_IF_ERROR(SyncDirectory(parent));
  TALLY_RETURN_IF_ERROR(ReachedStage("published"));
  // A previous checkpoint moved aside now, or by a save that crashed.
  fs::remove_all(previous, error);
  if (error) return ErrorCodeStatus(error, "remove previous checkpoint");
  return ReachedStage("removed previous");
}

// Removes what crashed saves of `<parent>/<name>` left: staging directories,
// and a previous checkpoint moved aside once `name` exists again.
void RemoveLeftovers(const fs::path& parent, const std::string& name) {
  std::error_code error;
  const std::string staging_prefix = StagingPrefix(name);
  for (fs::directory_iterator it(parent, error), end; !error && it != end;
       it.increment(error)) {
    if (absl::StartsWith(it->path().filename().string(), staging_prefix)) {
      std::error_code ignored;
      fs::remove_all(it->path(), ignored);
    }
  }
  if (fs::exists(parent / name, error)) {
    fs::remove_all(parent / PreviousName(name), error);
  }
}

// Writes `files` and the checksum list into the fresh `staging` directory
// and syncs it; returns the bytes written.
absl::StatusOr<uint64_t> FillStaging(const fs::path& staging,
                                     const std::vector<DirectoryFile>& files,
                                     const std::string& checksum_file) {
  uint64_t bytes = 0;
  TALLY_RETURN_IF_ERROR(ReachedStage("created staging directory"));
  std::string checksums;
  for (const DirectoryFile& file : files) {
    TALLY_ASSIGN_OR_RETURN(
        std::string digest,
        WriteFileDurably((staging / file.name).string(), file.pieces));
    for (absl::string_view piece : file.pieces) bytes += piece.size();
    absl::StrAppend(&checksums, digest, "  ", file.name, "\n");
    TALLY_RETURN_IF_ERROR(ReachedStage(absl::StrCat("wrote ", file.name)));
  }
  // Last: it covers every file above.
  TALLY_RETURN_IF_ERROR(
      WriteFileDurably((staging / checksum_file).string(), {checksums})
          .status());
  bytes += checksums.size();
  TALLY_RETURN_IF_ERROR(ReachedStage(absl::StrCat("wrote ", checksum_file)));
  TALLY_RETURN_IF_ERROR(SyncDirectory(staging.string()));
  TALLY_RETURN_IF_ERROR(ReachedStage("synced staging directory"));
  return bytes;
}

}  // namespace

std::string PublishedDir(const std::string& dir) {
  std::error_code error;
  if (fs::exists(dir, error)) return dir;
  fs::path target = fs::path(dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  const fs::path previous =
      target.parent_path() / PreviousName(target.filename().string());
  if (fs::is_directory(previous, error)) {
    Log(LogLevel::kWarning,
        absl::StrCat(dir,
                     " is missing but an interrupted save left its "
                     "previous contents at ",
                     previous.string(), "; reading that"));
    return previous.string();
  }
  return dir;
}

void SetPublishTestHooks(PublishTestHooks hooks) {
  TestHooks() = std::move(hooks);
}

absl::StatusOr<uint64_t> PublishDirectory(
    const std::string& target_dir, const std::vector<DirectoryFile>& files,
    const std::string& checksum_file) {
  const fs::path target(target_dir);
  const fs::path parent = target.parent_path();
  const std::string name = target.filename().string();
  std::error_code error;
  fs::create_directories(parent, error);
  if (error) {
    return ErrorCodeStatus(error,
                           absl::StrCat("create directory ", parent.string()));
  }
  RemoveLeftovers(parent, name);

  static std::atomic<uint64_t> staging_count{0};
  const fs::path staging =
      parent / absl::StrCat(StagingPrefix(name), ::getpid(), "-",
                            staging_count.fetch_add(1));
  if (!fs::create_directory(staging, error)) {
    return error ? ErrorCodeStatus(error,
                                   absl::StrCat("create ", staging.string()))
                 : absl::AlreadyExistsError(staging.string());
  }
  absl::StatusOr<uint64_t> bytes = FillStaging(staging, files, checksum_file);
  if (bytes.ok()) {
    if (absl::Status published = Publish(staging, target); !published.ok()) {
      bytes = published;
    }
  }
  // Whatever is left at the staging name (new files before publishing, the
  // previous directory after an exchange) is not needed.
  std::error_code ignored;
  fs::remove_all(staging, ignored);
  return bytes;
}

}  // namespace tally
