// Atomic directory publishing: a directory of files written so that a reader
// finds either the directory that was there or the complete new one — never
// a mix, even if the process or the machine dies midway. Checkpoints are
// published this way; the format of what is inside is checkpoint.h's.
//
// The files go to a hidden staging directory beside the target, each fsynced,
// then a checksum list of them (sha256sum format), the directory fsynced; one
// renameat2(RENAME_EXCHANGE) (or, where the filesystem cannot, two renames
// with the previous directory kept aside until the new one is in place)
// publishes it. PublishedDir finds the previous directory when a crash fell
// between the two renames; the next publish removes what a crash left.
//
//   TALLY_ASSIGN_OR_RETURN(uint64_t bytes, tally::PublishDirectory(
//       "/ckpt/step-000000000100",
//       {{"config.json", {json}}, {"model.safetensors", pieces}},
//       "checksums.sha256"));
#ifndef TALLY_RUNTIME_IO_ATOMIC_DIRECTORY_H_
#define TALLY_RUNTIME_IO_ATOMIC_DIRECTORY_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

struct DirectoryFile {
  std::string name;                       // a plain file name
  std::vector<absl::string_view> pieces;  // its contents, concatenated
};

// Publishes `files` as the directory `target` (an absolute, normalized path
// naming a directory), replacing what is there, with `checksum_file` written
// last to list the SHA-256 of every file. The parent directories are created
// when missing. On failure `target` is as it was. Returns the bytes written.
absl::StatusOr<uint64_t> PublishDirectory(
    const std::string& target, const std::vector<DirectoryFile>& files,
    const std::string& checksum_file);

// Where `dir`'s published contents are: `dir`, or the previous directory a
// publish moved aside when it crashed between its two renames.
std::string PublishedDir(const std::string& dir);

// Fault injection for tests: PublishDirectory calls the hook with the name of
// each step of its protocol as it reaches it — "created staging directory",
// "wrote <file>" per file in order and for the checksum file, "synced staging
// directory", then "exchanged" (with RENAME_EXCHANGE) or "moved previous
// aside" (without), "published" and "removed previous" — and fails
// with the hook's error, as if that step had failed; a hook may also end the
// process there to simulate a crash. `use_rename_exchange = false` takes the
// path for filesystems without renameat2(RENAME_EXCHANGE).
struct PublishTestHooks {
  std::function<absl::Status(absl::string_view stage)> at_stage;
  bool use_rename_exchange = true;
};
void SetPublishTestHooks(PublishTestHooks hooks);

}  // namespace tally

#endif  // TALLY_RUNTIME_IO_ATOMIC_DIRECTORY_H_
