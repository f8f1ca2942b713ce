// ArtifactDownload: the server-streaming reactor of DownloadArtifact. It
// writes the manifest message, then the ArtifactReader's chunks one write at
// a time (the next read starts when gRPC finished the previous write, so a
// slow client holds one chunk in memory, not the artifact), and finishes
// with the reader's error, CANCELLED when the client went away, or OK.
//
//   auto* download = new tally::ArtifactDownload(  // deletes itself
//       std::move(manifest_chunk), std::move(reader), /*manifest_only=*/false,
//       [](const absl::Status& status) { ... count it ... });
//   download->Start();
//   return download;  // from the handler
#ifndef TALLY_SERVER_ARTIFACT_DOWNLOAD_H_
#define TALLY_SERVER_ARTIFACT_DOWNLOAD_H_

#include <grpcpp/grpcpp.h>

#include <functional>

#include "absl/status/status.h"
#include "server/artifacts.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

class ArtifactDownload final
    : public grpc::ServerWriteReactor<v1::DownloadArtifactChunk> {
 public:
  ArtifactDownload(v1::DownloadArtifactChunk manifest, ArtifactReader reader,
                   bool manifest_only,
                   std::function<void(const absl::Status&)> on_finish);

  // Writes the manifest; the chunks follow from OnWriteDone.
  void Start();

  // Finishes a stream that never started (a refused request).
  static grpc::ServerWriteReactor<v1::DownloadArtifactChunk>* Refuse(
      const absl::Status& status,
      const std::function<void(const absl::Status&)>& on_finish);

  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  void End(const absl::Status& status);

  v1::DownloadArtifactChunk chunk_;  // the message being written
  ArtifactReader reader_;
  const bool manifest_only_;
  const std::function<void(const absl::Status&)> on_finish_;
};

}  // namespace tally

#endif  // TALLY_SERVER_ARTIFACT_DOWNLOAD_H_
