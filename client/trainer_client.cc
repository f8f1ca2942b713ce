#include "client/trainer_client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/error_reason.h"
#include "base/status.h"
#include "proto/grpc_status.h"

namespace tally {

TrainerClient::TrainerClient(const TrainerClientOptions& options)
    : TrainerClient(MakeChannel(options), options.deadline, options.retry,
                    options.token) {}

TrainerClient::TrainerClient(std::shared_ptr<grpc::Channel> channel,
                             absl::Duration deadline, RetryPolicy retry,
                             std::string token)
    : channel_(std::move(channel)),
      deadline_(deadline),
      retry_(retry),
      token_(std::move(token)),
      trainer_(v1::Trainer::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {}

std::shared_ptr<grpc::Channel> TrainerClient::MakeChannel(
    const TrainerClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (!options.tls.has_value()) {
    return grpc::CreateCustomChannel(options.target,
                                     grpc::InsecureChannelCredentials(), args);
  }
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.tls->ca_pem;
  ssl.pem_cert_chain = options.tls->cert_chain_pem;
  ssl.pem_private_key = options.tls->private_key_pem;
  if (!options.tls->server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls->server_name);
  }
  return grpc::CreateCustomChannel(options.target, grpc::SslCredentials(ssl),
                                   args);
}

void TrainerClient::Authorize(grpc::ClientContext& context) const {
  if (!token_.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
  }
}

void TrainerClient::SetDeadline(grpc::ClientContext& context,
                                absl::Time deadline) const {
  if (deadline != absl::InfiniteFuture()) {
    context.set_deadline(absl::ToChronoTime(deadline));
  }
}

template <typename Response, typename Rpc>
absl::StatusOr<Response> TrainerClient::Invoke(bool retryable, Rpc rpc) {
  absl::Duration backoff = retry_.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Now() + deadline_);
    Authorize(context);
    Response response;
    const absl::Status status = FromGrpcStatus(rpc(&context, &response));
    if (status.ok()) return response;
    const std::optional<ErrorReason> reason = ReasonOf(status);
    if (absl::IsAborted(status)) {
      absl::Status aborted = absl::AbortedError(absl::StrCat(
          status.message(),
          " (the accumulation window is poisoned: call AbortAccumulation, "
          "then redo the window's ForwardBackward calls)"));
      return reason ? WithReason(std::move(aborted), *reason) : aborted;
    }
    if (!retryable || !IsRetryable(status) || attempt >= retry_.max_attempts) {
      return status;
    }
    // The server's RetryInfo delay, when it gave one, is a floor.
    absl::SleepFor(std::max(
        backoff, reason ? RetryDelay(*reason).value_or(absl::ZeroDuration())
                        : absl::ZeroDuration()));
    backoff = std::min(backoff * 2, retry_.max_backoff);
  }
}

absl::StatusOr<v1::ModelInfo> TrainerClient::CreateModel(
    const v1::CreateModelRequest& request) {
  return Invoke<v1::ModelInfo>(false, [&](auto* context, auto* response) {
    return trainer_->CreateModel(context, request, response);
  });
}

absl::StatusOr<v1::ModelInfo> TrainerClient::GetModel(
    const v1::GetModelRequest& request) {
  return Invoke<v1::ModelInfo>(true, [&](auto* context, auto* response) {
    return trainer_->GetModel(context, request, response);
  });
}

absl::StatusOr<v1::ServerInfo> TrainerClient::GetServerInfo() {
  return Invoke<v1::ServerInfo>(true, [&](auto* context, auto* response) {
    return trainer_->GetServerInfo(context, v1::GetServerInfoRequest(),
                                   response);
  });
}

absl::StatusOr<v1::ListModelsResponse> TrainerClient::ListModels(
    const v1::ListModelsRequest& request) {
  return Invoke<v1::ListModelsResponse>(
      true, [&](auto* context, auto* response) {
        return trainer_->ListModels(context, request, response);
      });
}

absl::StatusOr<v1::ListModelsResponse> TrainerClient::ListAllModels() {
  v1::ListModelsRequest request;
  v1::ListModelsResponse all;
  do {
    TALLY_ASSIGN_OR_RETURN(v1::ListModelsResponse page, ListModels(request));
    for (v1::ModelInfo& model : *page.mutable_models()) {
      *all.add_models() = std::move(model);
    }
    for (v1::UnresumedModel& model : *page.mutable_unresumed()) {
      *all.add_unresumed() = std::move(model);
    }
    request.set_page_token(page.next_page_token());
  } while (!request.page_token().empty());
  return all;
}

absl::StatusOr<v1::DeleteModelResponse> TrainerClient::DeleteModel(
    const v1::DeleteModelRequest& request) {
  return Invoke<v1::DeleteModelResponse>(
      false, [&](auto* context, auto* response) {
        return trainer_->DeleteModel(context, request, response);
      });
}

absl::StatusOr<v1::ForwardBackwardResponse> TrainerClient::ForwardBackward(
    const v1::ForwardBackwardRequest& request) {
  return Invoke<v1::ForwardBackwardResponse>(
      request.seq_id() > 0, [&](auto* context, auto* response) {
        return trainer_->ForwardBackward(context, request, response);
      });
}

absl::StatusOr<v1::OptimStepResponse> TrainerClient::OptimStep(
    const v1::OptimStepRequest& request) {
  return Invoke<v1::OptimStepResponse>(
      request.seq_id() > 0, [&](auto* context, auto* response) {
        return trainer_->OptimStep(context, request, response);
      });
}

absl::StatusOr<v1::AbortAccumulationResponse> TrainerClient::AbortAccumulation(
    const v1::AbortAccumulationRequest& request) {
  return Invoke<v1::AbortAccumulationResponse>(
      request.seq_id() > 0, [&](auto* context, auto* response) {
        return trainer_->AbortAccumulation(context, request, response);
      });
}

absl::StatusOr<v1::SaveCheckpointResponse> TrainerClient::SaveCheckpoint(
    const v1::SaveCheckpointRequest& request) {
  return Invoke<v1::SaveCheckpointResponse>(
      request.seq_id() > 0, [&](auto* context, auto* response) {
        return trainer_->SaveCheckpoint(context, request, response);
      });
}

absl::StatusOr<v1::LoadCheckpointResponse> TrainerClient::LoadCheckpoint(
    const v1::LoadCheckpointRequest& request) {
  return Invoke<v1::LoadCheckpointResponse>(
      request.seq_id() > 0, [&](auto* context, auto* response) {
        return trainer_->LoadCheckpoint(context, request, response);
      });
}

absl::StatusOr<v1::ExportWeightsResponse> TrainerClient::ExportWeights(
    const v1::ExportWeightsRequest& request) {
  return Invoke<v1::ExportWeightsResponse>(
      request.seq_id() > 0, [&](auto* context, auto* response) {
        return trainer_->ExportWeights(context, request, response);
      });
}

absl::StatusOr<v1::SampleResponse> TrainerClient::Sample(
    const v1::SampleRequest& request) {
  return Invoke<v1::SampleResponse>(
      /*retryable=*/true, [&](auto* context, auto* response) {
        return trainer_->Sample(context, request, response);
      });
}

absl::StatusOr<v1::ComputeLogprobsResponse> TrainerClient::ComputeLogprobs(
    const v1::ComputeLogprobsRequest& request) {
  return Invoke<v1::ComputeLogprobsResponse>(
      /*retryable=*/true, [&](auto* context, auto* response) {
        return trainer_->ComputeLogprobs(context, request, response);
      });
}

absl::StatusOr<v1::SamplerInfo> TrainerClient::SaveWeightsForSampler(
    const v1::SaveWeightsForSamplerRequest& request) {
  return Invoke<v1::SamplerInfo>(
      request.seq_id() > 0, [&](auto* context, auto* response) {
        return trainer_->SaveWeightsForSampler(context, request, response);
      });
}

absl::StatusOr<v1::ListSamplersResponse> TrainerClient::ListSamplers(
    const v1::ListSamplersRequest& request) {
  return Invoke<v1::ListSamplersResponse>(
      /*retryable=*/true, [&](auto* context, auto* response) {
        return trainer_->ListSamplers(context, request, response);
      });
}

absl::StatusOr<v1::SamplerInfo> TrainerClient::DeleteSampler(
    const v1::DeleteSamplerRequest& request) {
  return Invoke<v1::SamplerInfo>(
      /*retryable=*/false, [&](auto* context, auto* response) {
        return trainer_->DeleteSampler(context, request, response);
      });
}

absl::Status TrainerClient::WaitForServing(absl::Duration timeout) {
  using grpc::health::v1::HealthCheckResponse;
  constexpr absl::Duration kMaxBackoff = absl::Seconds(1);
  // Even the check made as time runs out gets a fair chance to answer.
  constexpr absl::Duration kMinCheckTime = absl::Milliseconds(100);
  const absl::Time give_up = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(20);
  while (true) {
    grpc::ClientContext context;
    // wait_for_ready lets one Check ride out a server that is still binding
    // its port instead of failing at once with UNAVAILABLE.
    context.set_wait_for_ready(true);
    const absl::Time now = absl::Now();
    SetDeadline(context,
                now + std::clamp(give_up - now, kMinCheckTime, kMaxBackoff));
    grpc::health::v1::HealthCheckRequest request;
    HealthCheckResponse response;
    grpc::Status status = health_->Check(&context, request, &response);
    if (status.ok() && response.status() == HealthCheckResponse::SERVING) {
      return absl::OkStatus();
    }
    const absl::Duration remaining = give_up - absl::Now();
    if (remaining <= absl::ZeroDuration()) {
      const std::string last_answer =
          status.ok()
              ? absl::StrCat(
                    "health status ",
                    HealthCheckResponse::ServingStatus_Name(response.status()))
              : FromGrpcStatus(status).ToString();
      return absl::DeadlineExceededError(absl::StrCat(
          "server not SERVING after ", absl::FormatDuration(timeout),
          "; last answer: ", last_answer));
    }
    absl::SleepFor(std::min(backoff, remaining));
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

// Artifacts.

absl::StatusOr<v1::ListCheckpointsResponse> TrainerClient::ListCheckpoints(
    const v1::ListCheckpointsRequest& request) {
  return Invoke<v1::ListCheckpointsResponse>(
      /*retryable=*/true, [&](auto* context, auto* response) {
        return trainer_->ListCheckpoints(context, request, response);
      });
}

absl::StatusOr<v1::DeleteCheckpointResponse> TrainerClient::DeleteCheckpoint(
    const v1::DeleteCheckpointRequest& request) {
  return Invoke<v1::DeleteCheckpointResponse>(
      /*retryable=*/false, [&](auto* context, auto* response) {
        return trainer_->DeleteCheckpoint(context, request, response);
      });
}

namespace {

// Whether two manifests name the same files with the same contents.
bool SameManifest(const ArtifactManifest& a, const ArtifactManifest& b) {
  if (a.size() != b.size()) return false;
  for (int i = 0; i < a.size(); ++i) {
    if (a[i].path() != b[i].path() || a[i].size_bytes() != b[i].size_bytes() ||
        a[i].sha256() != b[i].sha256()) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<v1::DownloadArtifactChunk> TrainerClient::StreamArtifact(
    const std::string& handle, uint64_t offset, bool manifest_only,
    const std::string& local_dir,
    const std::function<void(uint64_t, uint64_t)>& progress) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Now() + deadline_);
  Authorize(context);
  v1::DownloadArtifactRequest request;
  request.set_handle(handle);
  request.set_offset(offset);
  request.set_manifest_only(manifest_only);
  std::unique_ptr<grpc::ClientReader<v1::DownloadArtifactChunk>> reader =
      trainer_->DownloadArtifact(&context, request);
  v1::DownloadArtifactChunk first;
  const bool got_first = reader->Read(&first);
  if (got_first && progress) progress(offset, first.total_bytes());
  absl::Status written;
  v1::DownloadArtifactChunk chunk;
  while (got_first && written.ok() && reader->Read(&chunk)) {
    written = WriteChunk(local_dir, chunk);
    if (written.ok() && progress) {
      progress(chunk.offset() + chunk.data().size(), first.total_bytes());
    }
  }
  if (!written.ok()) context.TryCancel();
  const absl::Status finished = FromGrpcStatus(reader->Finish());
  TALLY_RETURN_IF_ERROR(written);
  TALLY_RETURN_IF_ERROR(finished);
  if (!got_first) return absl::InternalError("the server sent no manifest");
  return first;
}

absl::StatusOr<ArtifactManifest> TrainerClient::DownloadArtifact(
    const std::string& handle, const std::string& local_dir,
    const std::function<void(uint64_t, uint64_t)>& progress) {
  TALLY_ASSIGN_OR_RETURN(
      const v1::DownloadArtifactChunk head,
      StreamArtifact(handle, 0, /*manifest_only=*/true, local_dir, nullptr));
  absl::Duration backoff = retry_.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    TALLY_ASSIGN_OR_RETURN(const uint64_t offset,
                           ResumeOffset(local_dir, head.manifest()));
    if (offset == head.total_bytes()) {
      if (progress) progress(offset, offset);
      break;
    }
    absl::StatusOr<v1::DownloadArtifactChunk> streamed = StreamArtifact(
        handle, offset, /*manifest_only=*/false, local_dir, progress);
    if (streamed.ok() && !SameManifest(streamed->manifest(), head.manifest())) {
      return absl::AbortedError(
          absl::StrCat(handle,
                       " was replaced during the download; download "
                       "it again into an empty directory"));
    }
    if (streamed.ok()) break;
    if (!IsRetryable(streamed.status()) || attempt >= retry_.max_attempts) {
      return streamed.status();
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, retry_.max_backoff);
  }
  TALLY_RETURN_IF_ERROR(VerifyFiles(local_dir, head.manifest()));
  return head.manifest();
}

}  // namespace tally
