// TrainerClient: a blocking C++ client for a tally server (tally.v1.Trainer
// plus grpc.health.v1), with every gRPC failure turned into an absl::Status
// carrying the same canonical code, message and ErrorReason
// (proto/grpc_status.h; ReasonOf(status) names the cause).
//
// Retries: failures that IsRetryable (base/error_reason.h) says a retry can
// fix (a full queue, a server shutting down or restarting a rank, a transport
// UNAVAILABLE or DEADLINE_EXCEEDED) are retried with exponential backoff,
// waiting at least the server's RetryInfo delay and sending the very same
// request again, for read-only calls and for mutating calls that carry a
// seq_id (> 0): the server executes a sequenced request once and answers a
// repeat with the cached response, so a retry is never applied twice. An
// unsequenced mutating call is never retried (it might have been applied);
// neither is a message too large or a memory limit. ABORTED (a poisoned
// window, a seq gap) is never retried: the message tells the caller to
// AbortAccumulation and redo the window.
//
//   tally::TrainerClientOptions options;
//   options.target = "localhost:50051";
//   tally::TrainerClient client(options);
//   TALLY_RETURN_IF_ERROR(client.WaitForServing(absl::Seconds(30)));
//
//   tally::v1::ForwardBackwardRequest fb;
//   fb.set_model_id("demo");
//   *fb.add_samples() = sample;
//   TALLY_ASSIGN_OR_RETURN(tally::v1::ForwardBackwardResponse out,
//                          client.ForwardBackward(fb));
//
//   tally::v1::OptimStepRequest step;
//   step.set_model_id("demo");
//   TALLY_ASSIGN_OR_RETURN(tally::v1::OptimStepResponse stepped,
//                          client.OptimStep(step));
#ifndef TALLY_CLIENT_TRAINER_CLIENT_H_
#define TALLY_CLIENT_TRAINER_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/artifact_files.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tally/v1/trainer.grpc.pb.h"

namespace tally {

struct RetryPolicy {
  // Attempts per call, the first included; 1 disables retries.
  int max_attempts = 5;
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
};

// A TLS channel: PEM text, not file names.
struct ClientTlsOptions {
  std::string ca_pem;  // the server's CA; empty: the system roots
  // Mutual TLS (the server's --tls-client-ca): this client's certificate
  // chain and key; both or neither.
  std::string cert_chain_pem;
  std::string private_key_pem;
  // The name the server's certificate must carry; empty: the target's host.
  std::string server_name;
};

struct TrainerClientOptions {
  std::string target = "localhost:50051";
  // Unset: plaintext (the server accepts it on loopback only, unless told).
  std::optional<ClientTlsOptions> tls;
  // Sent with every call as "authorization: Bearer <token>" (the server's
  // --auth-tokens-file); empty: none.
  std::string token;
  // Applied to every call; absl::InfiniteDuration() sets no deadline.
  absl::Duration deadline = absl::Minutes(10);
  // Large batches and logprobs overflow gRPC's default 4 MiB limit, so the
  // channel raises both the send and the receive limit to this.
  int max_message_bytes = 256 << 20;
  RetryPolicy retry;
};

class TrainerClient {
 public:
  // Opens a channel to options.target (TLS with options.tls). Connecting is
  // lazy: an unreachable server surfaces as UNAVAILABLE on the first call.
  explicit TrainerClient(const TrainerClientOptions& options);
  // Uses an existing channel (e.g. an in-process server's); `deadline`,
  // `retry` and `token` as in TrainerClientOptions.
  TrainerClient(std::shared_ptr<grpc::Channel> channel, absl::Duration deadline,
                RetryPolicy retry = {}, std::string token = "");

  // The channel TrainerClient(options) would open.
  static std::shared_ptr<grpc::Channel> MakeChannel(
      const TrainerClientOptions& options);

  absl::StatusOr<v1::ModelInfo> CreateModel(
      const v1::CreateModelRequest& request);
  absl::StatusOr<v1::ModelInfo> GetModel(const v1::GetModelRequest& request);
  absl::StatusOr<v1::ServerInfo> GetServerInfo();
  absl::StatusOr<v1::ListModelsResponse> ListModels(
      const v1::ListModelsRequest& request);
  // Every page of ListModels in one response (next_page_token empty).
  absl::StatusOr<v1::ListModelsResponse> ListAllModels();
  absl::StatusOr<v1::DeleteModelResponse> DeleteModel(
      const v1::DeleteModelRequest& request);
  absl::StatusOr<v1::ForwardBackwardResponse> ForwardBackward(
      const v1::ForwardBackwardRequest& request);
  absl::StatusOr<v1::OptimStepResponse> OptimStep(
      const v1::OptimStepRequest& request);
  absl::StatusOr<v1::AbortAccumulationResponse> AbortAccumulation(
      const v1::AbortAccumulationRequest& request);
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(
      const v1::SaveCheckpointRequest& request);
  absl::StatusOr<v1::LoadCheckpointResponse> LoadCheckpoint(
      const v1::LoadCheckpointRequest& request);
  absl::StatusOr<v1::ExportWeightsResponse> ExportWeights(
      const v1::ExportWeightsRequest& request);
  // Retried on transient failures whether sequenced or not: neither changes
  // the model.
  absl::StatusOr<v1::SampleResponse> Sample(const v1::SampleRequest& request);
  absl::StatusOr<v1::ComputeLogprobsResponse> ComputeLogprobs(
      const v1::ComputeLogprobsRequest& request);
  // Sampler snapshots: a Sample or ComputeLogprobs request names one in its
  // `sampler` field. SaveWeightsForSampler is retried when sequenced (the
  // server answers a repeated seq_id from its cache), DeleteSampler never
  // (a retry of an applied delete would be NOT_FOUND); ListSamplers is
  // read-only.
  absl::StatusOr<v1::SamplerInfo> SaveWeightsForSampler(
      const v1::SaveWeightsForSamplerRequest& request);
  absl::StatusOr<v1::ListSamplersResponse> ListSamplers(
      const v1::ListSamplersRequest& request);
  absl::StatusOr<v1::SamplerInfo> DeleteSampler(
      const v1::DeleteSamplerRequest& request);

  // Polls grpc.health.v1 Check (service "") with exponential backoff until
  // the server reports SERVING. DEADLINE_EXCEEDED after `timeout`, with the
  // last answer (a status or a serving state) in the message.
  absl::Status WaitForServing(absl::Duration timeout);

  // Artifacts (tally:// handles; the server's --checkpoint-root).
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(
      const v1::ListCheckpointsRequest& request);
  // Not retried: a repeat of an applied delete would be NOT_FOUND.
  absl::StatusOr<v1::DeleteCheckpointResponse> DeleteCheckpoint(
      const v1::DeleteCheckpointRequest& request);
  // Downloads the artifact `handle` into `local_dir` (created), resuming
  // after the bytes already there (client/artifact_files.h), and verifies
  // every file's SHA-256 (DATA_LOSS naming a mismatch). `progress`, when
  // set, gets (bytes held, total) after the manifest and after each chunk.
  // Returns the manifest. A broken stream is resumed up to the retry
  // policy's attempts.
  absl::StatusOr<ArtifactManifest> DownloadArtifact(
      const std::string& handle, const std::string& local_dir,
      const std::function<void(uint64_t, uint64_t)>& progress = nullptr);

 private:
  // One DownloadArtifact stream from `offset` (manifest-only when asked):
  // its first message, the data chunks written into `local_dir`.
  absl::StatusOr<v1::DownloadArtifactChunk> StreamArtifact(
      const std::string& handle, uint64_t offset, bool manifest_only,
      const std::string& local_dir,
      const std::function<void(uint64_t, uint64_t)>& progress);

  // Runs `rpc(context, response)` under the configured deadline (per
  // attempt), retrying transient failures when `retryable`.
  template <typename Response, typename Rpc>
  absl::StatusOr<Response> Invoke(bool retryable, Rpc rpc);

  void SetDeadline(grpc::ClientContext& context, absl::Time deadline) const;
  // The bearer token, when there is one.
  void Authorize(grpc::ClientContext& context) const;

  std::shared_ptr<grpc::Channel> channel_;
  absl::Duration deadline_;
  RetryPolicy retry_;
  std::string token_;
  std::unique_ptr<v1::Trainer::Stub> trainer_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

}  // namespace tally

#endif  // TALLY_CLIENT_TRAINER_CLIENT_H_
