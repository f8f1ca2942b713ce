#include "server/artifact_download.h"

#include <utility>

#include "proto/grpc_status.h"

namespace tally {
namespace {

// A reactor that only finishes with a status.
class RefusedDownload final
    : public grpc::ServerWriteReactor<v1::DownloadArtifactChunk> {
 public:
  explicit RefusedDownload(const absl::Status& status) {
    Finish(ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

}  // namespace

ArtifactDownload::ArtifactDownload(
    v1::DownloadArtifactChunk manifest, ArtifactReader reader,
    bool manifest_only, std::function<void(const absl::Status&)> on_finish)
    : chunk_(std::move(manifest)),
      reader_(std::move(reader)),
      manifest_only_(manifest_only),
      on_finish_(std::move(on_finish)) {}

void ArtifactDownload::Start() { StartWrite(&chunk_); }

grpc::ServerWriteReactor<v1::DownloadArtifactChunk>* ArtifactDownload::Refuse(
    const absl::Status& status,
    const std::function<void(const absl::Status&)>& on_finish) {
  on_finish(status);
  return new RefusedDownload(status);
}

void ArtifactDownload::OnWriteDone(bool ok) {
  if (!ok) {
    End(absl::CancelledError("the client stopped reading the download"));
    return;
  }
  if (manifest_only_) {
    End(absl::OkStatus());
    return;
  }
  absl::StatusOr<bool> more = reader_.Next(&chunk_);
  if (!more.ok()) {
    End(more.status());
  } else if (!*more) {
    End(absl::OkStatus());
  } else {
    StartWrite(&chunk_);
  }
}

void ArtifactDownload::End(const absl::Status& status) {
  on_finish_(status);
  Finish(ToGrpcStatus(status));
}

}  // namespace tally
