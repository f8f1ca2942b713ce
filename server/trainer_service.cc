#include "server/trainer_service.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "runtime/log.h"
#include "runtime/status.h"
#include "server/commands.h"
#include "server/convert.h"

namespace tally {
namespace {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// Deterministic, so a cached response is the bytes the first caller got.
std::string SerializeDeterministically(
    const google::protobuf::Message& message) {
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  message.SerializeToCodedStream(&coded);
  coded.Trim();
  return bytes;
}

}  // namespace

TrainerService::TrainerService(Engine* engine, CommandExecutor* executor,
                               ServerMetrics* metrics, Options options)
    : engine_(engine),
      executor_(executor),
      metrics_(metrics),
      options_(std::move(options)),
      budget_(options_.max_queued_requests,
              options_.max_queued_requests_per_model),
      sequencer_(options_.sequencing,
                 SequencerHooks{[executor](std::function<void()> work) {
                                  return executor->Submit(std::move(work));
                                },
                                [this](const std::string& model_id) {
                                  PoisonForGap(model_id);
                                },
                                [metrics](const std::string& model_id) {
                                  metrics->RecordDuplicate(model_id);
                                },
                                [metrics](double seconds) {
                                  metrics->RecordSeqGapWait(seconds);
                                }}) {
  for (const ModelSummary& model : engine_->ListModels()) {
    sequencer_.AddModel(model.model_id);
  }
}

void TrainerService::StopExecuting() {
  stopped_ = true;
  sequencer_.Stop(absl::UnavailableError(
      "the server is shutting down before this request ran; retry it on the "
      "restarted server"));
}

absl::Status TrainerService::Accepting() const {
  {
    absl::MutexLock lock(&failure_mu_);
    if (!rank_failure_.ok()) {
      return absl::UnavailableError(
          absl::StrCat("a rank of this server failed and it is restarting (",
                       rank_failure_.message(), ")"));
    }
  }
  if (stopped_) {
    return absl::UnavailableError(
        "the server is shutting down before this request ran; retry it on "
        "the restarted server");
  }
  return absl::OkStatus();
}

absl::Status TrainerService::Precheck(
    grpc::CallbackServerContext* context) const {
  TALLY_RETURN_IF_ERROR(Accepting());
  if (context->IsCancelled()) {
    return absl::CancelledError("cancelled by the client before it ran");
  }
  if (context->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError(
        "the deadline passed before the request ran");
  }
  return absl::OkStatus();
}

absl::Status TrainerService::RunCommand(
    const std::function<absl::Status()>& command) {
  absl::Status status = command();
  absl::Status failure = engine_->CollectiveFailure();
  if (failure.ok()) return status;
  OnRankFailure(failure);
  return Accepting();
}

void TrainerService::OnRankFailure(const absl::Status& failure) {
  {
    absl::MutexLock lock(&failure_mu_);
    if (!rank_failure_.ok()) return;
    rank_failure_ = failure;
  }
  Log(LogLevel::kError,
      absl::StrCat("a collective failed, so a rank is dead or hung; answering "
                   "UNAVAILABLE and exiting: ",
                   failure.ToString()));
  metrics_->RecordRankFailure();
  sequencer_.Stop(Accepting());
  if (options_.on_rank_failure) options_.on_rank_failure(failure);
}

absl::Status TrainerService::CountingPoison(
    const std::string& model_id, const std::function<absl::Status()>& command) {
  const bool was_poisoned = engine_->WindowPoisoned(model_id).value_or(false);
  absl::Status status = command();
  if (!was_poisoned && engine_->WindowPoisoned(model_id).value_or(false)) {
    metrics_->RecordPoisonedWindow(model_id);
  }
  return status;
}

void TrainerService::PoisonForGap(const std::string& model_id) {
  // Queued before the waiting requests are answered, so an OptimStep sent
  // after their ABORTED runs after it.
  executor_->Submit([this, model_id] {
    if (!Accepting().ok()) return;
    absl::Status poisoned = RunCommand([&]() -> absl::Status {
      v1::GetModelRequest request;
      request.set_model_id(model_id);
      v1::ModelInfo model;
      TALLY_RETURN_IF_ERROR(ReplicateCommand(engine_->control(),
                                             Command::kPoisonWindow, request));
      return CountingPoison(model_id, [&] {
        return ExecutePoisonWindow(*engine_, request, &model);
      });
    });
    if (!poisoned.ok()) {
      // The model was deleted meanwhile, or the server is failing.
      Log(LogLevel::kDebug,
          absl::StrCat("poisoning '", model_id, "': ", poisoned.ToString()));
    }
  });
}

void TrainerService::FillNextSeqId(v1::ModelInfo* info) const {
  info->set_next_seq_id(sequencer_.NextSeqId(info->model_id()).value_or(1));
}

void TrainerService::Finish(const char* method,
                            grpc::ServerUnaryReactor* reactor,
                            const absl::Status& status) {
  metrics_->RecordRequest(method, absl::StatusCodeToString(status.code()));
  reactor->Finish(ToGrpc(status));
}

grpc::ServerUnaryReactor* TrainerService::Execute(
    const Call& call, absl::Status validation,
    std::function<absl::Status()> command) {
  grpc::ServerUnaryReactor* reactor = call.context->DefaultReactor();
  if (validation.ok()) validation = Accepting();
  if (validation.ok()) validation = budget_.Acquire(call.model_id);
  if (!validation.ok()) {
    Finish(call.method, reactor, validation);
    return reactor;
  }
  metrics_->SetQueueDepth(budget_.held());
  auto finish = [this, method = call.method, reactor,
                 model_id = call.model_id](const absl::Status& status) {
    budget_.Release(model_id);
    metrics_->SetQueueDepth(budget_.held());
    Finish(method, reactor, status);
  };
  grpc::CallbackServerContext* context = call.context;
  if (call.seq_id == 0) {
    const bool queued = executor_->Submit([this, context, command, finish] {
      absl::Status status = Precheck(context);
      if (status.ok()) status = RunCommand(command);
      finish(status);
    });
    if (!queued) finish(absl::UnavailableError("the server is shutting down"));
    return reactor;
  }
  google::protobuf::Message* response = call.response;
  SequencedRequest sequenced;
  sequenced.seq_id = call.seq_id;
  sequenced.fingerprint = RequestFingerprint(*call.request);
  sequenced.precheck = [this, context] { return Precheck(context); };
  sequenced.execute = [this, command, response] {
    SequencedOutcome outcome;
    outcome.status = RunCommand(command);
    if (outcome.status.ok()) {
      outcome.response = SerializeDeterministically(*response);
    }
    return outcome;
  };
  sequenced.reply = [response, finish](const SequencedOutcome& outcome) {
    if (outcome.status.ok() && !response->ParseFromString(outcome.response)) {
      finish(absl::InternalError("cannot parse the cached response"));
      return;
    }
    finish(outcome.status);
  };
  sequencer_.Submit(call.model_id, std::move(sequenced));
  return reactor;
}

grpc::ServerUnaryReactor* TrainerService::CreateModel(
    grpc::CallbackServerContext* context, const v1::CreateModelRequest* request,
    v1::ModelInfo* response) {
  return Execute(
      {"CreateModel", context, request->model_id()},
      ParseCreateModel(*request).status(),
      [this, request, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(ReplicateCommand(
            engine_->control(), Command::kCreateModel, *request));
        TALLY_RETURN_IF_ERROR(ExecuteCreateModel(*engine_, *request, response));
        sequencer_.AddModel(response->model_id());
        FillNextSeqId(response);
        metrics_->SetModelCount(engine_->num_models());
        metrics_->SetPendingTokens(response->model_id(), 0);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::GetModel(
    grpc::CallbackServerContext* context, const v1::GetModelRequest* request,
    v1::ModelInfo* response) {
  return Execute({"GetModel", context, request->model_id()},
                 ValidateModelId(request->model_id()),
                 [this, request, response]() -> absl::Status {
                   TALLY_ASSIGN_OR_RETURN(
                       ModelSummary summary,
                       engine_->GetModel(request->model_id()));
                   ToProto(summary, response);
                   FillNextSeqId(response);
                   return absl::OkStatus();
                 });
}

grpc::ServerUnaryReactor* TrainerService::ListModels(
    grpc::CallbackServerContext* context, const v1::ListModelsRequest* request,
    v1::ListModelsResponse* response) {
  return Execute({"ListModels", context, ""}, absl::OkStatus(),
                 [this, response]() -> absl::Status {
                   for (const ModelSummary& s : engine_->ListModels()) {
                     v1::ModelInfo* info = response->add_models();
                     ToProto(s, info);
                     FillNextSeqId(info);
                   }
                   return absl::OkStatus();
                 });
}

grpc::ServerUnaryReactor* TrainerService::DeleteModel(
    grpc::CallbackServerContext* context, const v1::DeleteModelRequest* request,
    v1::DeleteModelResponse* response) {
  return Execute(
      {"DeleteModel", context, request->model_id()},
      ValidateModelId(request->model_id()),
      [this, request, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(ReplicateCommand(
            engine_->control(), Command::kDeleteModel, *request));
        TALLY_RETURN_IF_ERROR(ExecuteDeleteModel(*engine_, *request, response));
        FillNextSeqId(response->mutable_model());
        sequencer_.RemoveModel(request->model_id());
        metrics_->RemoveModel(request->model_id());
        metrics_->SetModelCount(engine_->num_models());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::ForwardBackward(
    grpc::CallbackServerContext* context,
    const v1::ForwardBackwardRequest* request,
    v1::ForwardBackwardResponse* response) {
  return Execute(
      {"ForwardBackward", context, request->model_id(), request->seq_id(),
       request, response},
      ParseForwardBackward(*request).status(),
      [this, request, response]() -> absl::Status {
        const auto start = std::chrono::steady_clock::now();
        TALLY_RETURN_IF_ERROR(ReplicateCommand(
            engine_->control(), Command::kForwardBackward, *request));
        TALLY_RETURN_IF_ERROR(CountingPoison(request->model_id(), [&] {
          return ExecuteForwardBackward(*engine_, *request, response);
        }));
        metrics_->RecordForwardBackward(request->model_id(), *response,
                                        !request->forward_only(),
                                        SecondsSince(start));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::OptimStep(
    grpc::CallbackServerContext* context, const v1::OptimStepRequest* request,
    v1::OptimStepResponse* response) {
  return Execute(
      {"OptimStep", context, request->model_id(), request->seq_id(), request,
       response},
      ParseOptimStep(*request).status(),
      [this, request, response]() -> absl::Status {
        const auto start = std::chrono::steady_clock::now();
        TALLY_RETURN_IF_ERROR(ReplicateCommand(engine_->control(),
                                               Command::kOptimStep, *request));
        TALLY_RETURN_IF_ERROR(CountingPoison(request->model_id(), [&] {
          return ExecuteOptimStep(*engine_, *request, response);
        }));
        metrics_->RecordOptimStep(request->model_id(), *response,
                                  SecondsSince(start));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::AbortAccumulation(
    grpc::CallbackServerContext* context,
    const v1::AbortAccumulationRequest* request,
    v1::AbortAccumulationResponse* response) {
  return Execute(
      {"AbortAccumulation", context, request->model_id(), request->seq_id(),
       request, response},
      ValidateModelId(request->model_id()),
      [this, request, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(ReplicateCommand(
            engine_->control(), Command::kAbortAccumulation, *request));
        TALLY_RETURN_IF_ERROR(
            ExecuteAbortAccumulation(*engine_, *request, response));
        metrics_->SetPendingTokens(request->model_id(), 0);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::SaveCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::SaveCheckpointRequest* request,
    v1::SaveCheckpointResponse* response) {
  absl::Status validation = ValidateModelId(request->model_id());
  if (validation.ok()) validation = ValidateCheckpointPath(request->path());
  return Execute({"SaveCheckpoint", context, request->model_id(),
                  request->seq_id(), request, response},
                 validation, [this, request, response]() -> absl::Status {
                   TALLY_RETURN_IF_ERROR(ReplicateCommand(
                       engine_->control(), Command::kSaveCheckpoint, *request));
                   return ExecuteSaveCheckpoint(*engine_, *request, response);
                 });
}

grpc::ServerUnaryReactor* TrainerService::LoadCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::LoadCheckpointRequest* request,
    v1::LoadCheckpointResponse* response) {
  absl::Status validation = ValidateModelId(request->model_id());
  if (validation.ok()) validation = ValidateCheckpointPath(request->path());
  return Execute(
      {"LoadCheckpoint", context, request->model_id(), request->seq_id(),
       request, response},
      validation, [this, request, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(ReplicateCommand(
            engine_->control(), Command::kLoadCheckpoint, *request));
        TALLY_RETURN_IF_ERROR(CountingPoison(request->model_id(), [&] {
          return ExecuteLoadCheckpoint(*engine_, *request, response);
        }));
        // A sequenced load is itself the model's current seq_id.
        if (request->seq_id() > 0) {
          response->mutable_model()->set_next_seq_id(request->seq_id() + 1);
        } else {
          FillNextSeqId(response->mutable_model());
        }
        metrics_->SetPendingTokens(request->model_id(), 0);
        return absl::OkStatus();
      });
}

}  // namespace tally
