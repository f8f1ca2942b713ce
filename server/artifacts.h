// Artifacts: the checkpoints (SaveCheckpoint) and weight exports
// (ExportWeights) a tenant saved under --checkpoint-root, as the API names
// them: `tally://<path under the tenant's root>` handles, never server paths.
// Lists them, deletes them, reads their files for a download (a manifest
// from checksums.sha256, then chunks from an offset), and deletes those whose
// ttl expired. Without LibTorch, so it is tested (and could be fuzzed) alone.
//
// An artifact is a directory below the tenant's root that holds
// checksums.sha256 (both kinds write one last); tally.json makes it a state
// checkpoint, its absence an export. The service records who saved it and
// when it expires in a hidden `.tally-artifact.json` inside it, which
// downloads leave out (the manifest lists checksums.sha256's files and the
// list itself).
//
//   tally::ArtifactStore store("/srv/ckpt");
//   TALLY_ASSIGN_OR_RETURN(std::string dir,
//                          store.Resolve("alice", "tally://run1/s3"));
//   // dir == "/srv/ckpt/alice/run1/s3" (its symlinks resolved)
//   tally::ArtifactRecord record;
//   record.model_id = "m";
//   record.expires = tally::ExpiryOf(absl::Now(), /*ttl_seconds=*/3600);
//   TALLY_RETURN_IF_ERROR(store.Record(dir, record));
//   TALLY_ASSIGN_OR_RETURN(auto listed, store.List("alice", /*model_id=*/""));
//   TALLY_ASSIGN_OR_RETURN(auto files, store.Manifest(dir));
//   tally::ArtifactReader reader(dir, files, /*offset=*/0);
//   v1::DownloadArtifactChunk chunk;
//   while (reader.Next(&chunk).value_or(false)) { ... send chunk ... }
//   store.SweepExpired(absl::Now());
#ifndef TALLY_SERVER_ARTIFACTS_H_
#define TALLY_SERVER_ARTIFACTS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

inline constexpr char kHandleScheme[] = "tally://";

// What the service records of an artifact when it saves one.
struct ArtifactRecord {
  std::string model_id;  // the client's id
  int64_t step = 0;
  absl::Time created = absl::UnixEpoch();
  absl::Time expires = absl::InfiniteFuture();  // no ttl
};

// `created` + `ttl_seconds` (InfiniteFuture for 0).
absl::Time ExpiryOf(absl::Time created, uint64_t ttl_seconds);

class ArtifactStore {
 public:
  // `root`: --checkpoint-root; a tenant's artifacts live in <root>/<tenant>
  // (in <root> itself for the tenant "", without authentication).
  explicit ArtifactStore(std::string root) : root_(std::move(root)) {}

  std::string TenantRoot(const std::string& tenant) const;

  // The directory `handle` names in `tenant`'s root: INVALID_ARGUMENT
  // (naming `field`) for a handle without the tally:// scheme, an empty,
  // absolute or ".." path, or one whose symlinks lead out of the root;
  // NOT_FOUND when it names no artifact there (another tenant's handle
  // included: its path does not exist in this tenant's root).
  absl::StatusOr<std::string> Resolve(const std::string& tenant,
                                      const std::string& handle,
                                      const char* field = "handle") const;

  // The handle of `dir`, a confined path (ConfineToRoot) in `tenant`'s root.
  absl::StatusOr<std::string> HandleOf(const std::string& tenant,
                                       const std::string& dir) const;

  // Writes `record` into the artifact directory `dir` (replacing one).
  absl::Status Record(const std::string& dir,
                      const ArtifactRecord& record) const;

  // `tenant`'s artifacts (of `model_id` only, unless empty), sorted by
  // handle.
  absl::StatusOr<std::vector<v1::Artifact>> List(
      const std::string& tenant, const std::string& model_id) const;

  // Removes the artifact `handle` names; returns what it was.
  absl::StatusOr<v1::Artifact> Delete(const std::string& tenant,
                                      const std::string& handle) const;

  // The files a download of the artifact `dir` sends, in order: those
  // checksums.sha256 lists (with their listed digests), then the list
  // itself. DATA_LOSS for a malformed list or a listed file that is missing.
  absl::StatusOr<std::vector<v1::ArtifactFile>> Manifest(
      const std::string& dir) const;

  // Deletes every artifact of every tenant whose expiry is at or before
  // `now`; returns how many. Failures are logged.
  int SweepExpired(absl::Time now) const;

 private:
  // The artifact at `dir` (a directory holding checksums.sha256), its
  // handle `handle`.
  v1::Artifact Describe(const std::string& dir,
                        const std::string& handle) const;
  // Every artifact directory below `tenant_root` (hidden directories, such
  // as a save's staging, skipped), with its path relative to that root.
  std::vector<std::pair<std::string, std::string>> Walk(
      const std::string& tenant_root) const;

  std::string root_;
};

// The data chunks of a download: the manifest's files concatenated, from
// `offset` on, at most `chunk_bytes` per chunk and never across two files.
class ArtifactReader {
 public:
  static constexpr uint64_t kDefaultChunkBytes = 1 << 20;

  ArtifactReader(std::string dir, std::vector<v1::ArtifactFile> manifest,
                 uint64_t offset, uint64_t chunk_bytes = kDefaultChunkBytes);

  // The files' total size; OUT_OF_RANGE when the offset lies past it.
  absl::StatusOr<uint64_t> Validate() const;
  // Fills `chunk` with the next piece and returns true; false after the
  // last. DATA_LOSS when a file is shorter than its manifest size.
  absl::StatusOr<bool> Next(v1::DownloadArtifactChunk* chunk);

 private:
  std::string dir_;
  std::vector<v1::ArtifactFile> manifest_;
  uint64_t offset_;
  uint64_t chunk_bytes_;
};

}  // namespace tally

#endif  // TALLY_SERVER_ARTIFACTS_H_
