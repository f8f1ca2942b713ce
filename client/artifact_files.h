// Artifact files: the local side of DownloadArtifact. From the server's
// manifest (each file's path, size and SHA-256) it finds where a download
// into a directory resumes (the bytes already there, in manifest order),
// writes each chunk at its place, and verifies every file's checksum at the
// end. Paths from the server are checked to be plain names in the directory.
//
//   TALLY_ASSIGN_OR_RETURN(uint64_t offset,
//                          tally::ResumeOffset(local_dir, manifest));
//   ... DownloadArtifact(handle, offset); for each data chunk:
//   TALLY_RETURN_IF_ERROR(tally::WriteChunk(local_dir, chunk));
//   TALLY_RETURN_IF_ERROR(tally::VerifyFiles(local_dir, manifest));
#ifndef TALLY_CLIENT_ARTIFACT_FILES_H_
#define TALLY_CLIENT_ARTIFACT_FILES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

using ArtifactManifest = google::protobuf::RepeatedPtrField<v1::ArtifactFile>;

// The offset to resume a download of `manifest` into `dir` (created) from:
// the whole files there count, then the first short one's bytes. A file
// longer than its manifest size is truncated to 0 (it is not this
// artifact's); later files are then rewritten. DATA_LOSS for a manifest
// path that is not a plain file name.
absl::StatusOr<uint64_t> ResumeOffset(const std::string& dir,
                                      const ArtifactManifest& manifest);

// Writes `chunk`'s data at its file_offset in dir/<path>.
absl::Status WriteChunk(const std::string& dir,
                        const v1::DownloadArtifactChunk& chunk);

// Every manifest file in `dir` has its size and SHA-256; DATA_LOSS naming
// the first that does not (and deleting it, so that a rerun fetches it
// again).
absl::Status VerifyFiles(const std::string& dir,
                         const ArtifactManifest& manifest);

}  // namespace tally

#endif  // TALLY_CLIENT_ARTIFACT_FILES_H_
