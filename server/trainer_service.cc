#include "server/trainer_service.h"

#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
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

}  // namespace

void TrainerService::Finish(const char* method,
                            grpc::ServerUnaryReactor* reactor,
                            const absl::Status& status) {
  metrics_->RecordRequest(method, absl::StatusCodeToString(status.code()));
  reactor->Finish(ToGrpc(status));
}

grpc::ServerUnaryReactor* TrainerService::Execute(
    const char* method, grpc::CallbackServerContext* context,
    absl::Status validation, std::function<absl::Status()> command) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!validation.ok()) {
    Finish(method, reactor, validation);
    return reactor;
  }
  bool queued = executor_->Submit([this, method, context, reactor, command] {
    absl::Status status;
    if (context->IsCancelled()) {
      status = absl::CancelledError("cancelled by the client before it ran");
    } else if (context->deadline() < std::chrono::system_clock::now()) {
      status = absl::DeadlineExceededError(
          "the deadline passed before the request ran");
    } else {
      status = command();
    }
    Finish(method, reactor, status);
  });
  if (!queued) {
    Finish(method, reactor,
           absl::UnavailableError("the server is shutting down"));
  }
  return reactor;
}

grpc::ServerUnaryReactor* TrainerService::CreateModel(
    grpc::CallbackServerContext* context, const v1::CreateModelRequest* request,
    v1::ModelInfo* response) {
  return Execute(
      "CreateModel", context, ParseCreateModel(*request).status(),
      [this, request, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(
            ReplicateCommand(*control_, Command::kCreateModel, *request));
        TALLY_RETURN_IF_ERROR(ExecuteCreateModel(*engine_, *request, response));
        metrics_->SetModelCount(engine_->num_models());
        metrics_->SetPendingTokens(response->model_id(), 0);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::GetModel(
    grpc::CallbackServerContext* context, const v1::GetModelRequest* request,
    v1::ModelInfo* response) {
  return Execute("GetModel", context, ValidateModelId(request->model_id()),
                 [this, request, response]() -> absl::Status {
                   TALLY_ASSIGN_OR_RETURN(
                       ModelSummary summary,
                       engine_->GetModel(request->model_id()));
                   ToProto(summary, response);
                   return absl::OkStatus();
                 });
}

grpc::ServerUnaryReactor* TrainerService::ListModels(
    grpc::CallbackServerContext* context, const v1::ListModelsRequest* request,
    v1::ListModelsResponse* response) {
  return Execute("ListModels", context, absl::OkStatus(),
                 [this, response]() -> absl::Status {
                   for (const ModelSummary& s : engine_->ListModels()) {
                     ToProto(s, response->add_models());
                   }
                   return absl::OkStatus();
                 });
}

grpc::ServerUnaryReactor* TrainerService::DeleteModel(
    grpc::CallbackServerContext* context, const v1::DeleteModelRequest* request,
    v1::DeleteModelResponse* response) {
  return Execute(
      "DeleteModel", context, ValidateModelId(request->model_id()),
      [this, request, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(
            ReplicateCommand(*control_, Command::kDeleteModel, *request));
        TALLY_RETURN_IF_ERROR(ExecuteDeleteModel(*engine_, *request, response));
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
      "ForwardBackward", context, ParseForwardBackward(*request).status(),
      [this, request, response]() -> absl::Status {
        const auto start = std::chrono::steady_clock::now();
        TALLY_RETURN_IF_ERROR(
            ReplicateCommand(*control_, Command::kForwardBackward, *request));
        TALLY_RETURN_IF_ERROR(
            ExecuteForwardBackward(*engine_, *request, response));
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
      "OptimStep", context, ParseOptimStep(*request).status(),
      [this, request, response]() -> absl::Status {
        const auto start = std::chrono::steady_clock::now();
        TALLY_RETURN_IF_ERROR(
            ReplicateCommand(*control_, Command::kOptimStep, *request));
        TALLY_RETURN_IF_ERROR(ExecuteOptimStep(*engine_, *request, response));
        metrics_->RecordOptimStep(request->model_id(), *response,
                                  SecondsSince(start));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::AbortAccumulation(
    grpc::CallbackServerContext* context,
    const v1::AbortAccumulationRequest* request,
    v1::AbortAccumulationResponse* response) {
  return Execute("AbortAccumulation", context,
                 ValidateModelId(request->model_id()),
                 [this, request, response]() -> absl::Status {
                   TALLY_RETURN_IF_ERROR(ReplicateCommand(
                       *control_, Command::kAbortAccumulation, *request));
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
  return Execute("SaveCheckpoint", context, validation,
                 [this, request, response]() -> absl::Status {
                   TALLY_RETURN_IF_ERROR(ReplicateCommand(
                       *control_, Command::kSaveCheckpoint, *request));
                   return ExecuteSaveCheckpoint(*engine_, *request, response);
                 });
}

grpc::ServerUnaryReactor* TrainerService::LoadCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::LoadCheckpointRequest* request,
    v1::LoadCheckpointResponse* response) {
  absl::Status validation = ValidateModelId(request->model_id());
  if (validation.ok()) validation = ValidateCheckpointPath(request->path());
  return Execute("LoadCheckpoint", context, validation,
                 [this, request, response]() -> absl::Status {
                   TALLY_RETURN_IF_ERROR(ReplicateCommand(
                       *control_, Command::kLoadCheckpoint, *request));
                   TALLY_RETURN_IF_ERROR(
                       ExecuteLoadCheckpoint(*engine_, *request, response));
                   metrics_->SetPendingTokens(request->model_id(), 0);
                   return absl::OkStatus();
                 });
}

}  // namespace tally
