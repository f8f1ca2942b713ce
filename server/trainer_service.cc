#include "server/trainer_service.h"

#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"
#include "server/convert.h"

namespace tally {
namespace {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                       start)
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
  auto spec = std::make_shared<absl::StatusOr<ModelSpec>>(
      ParseCreateModel(*request));
  return Execute("CreateModel", context, spec->status(),
                 [this, spec, response]() -> absl::Status {
                   TALLY_ASSIGN_OR_RETURN(ModelSummary summary,
                                          engine_->CreateModel(**spec));
                   metrics_->SetModelCount(engine_->num_models());
                   metrics_->SetPendingTokens(summary.model_id, 0);
                   ToProto(summary, response);
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
  return Execute("DeleteModel", context, ValidateModelId(request->model_id()),
                 [this, request, response]() -> absl::Status {
                   TALLY_ASSIGN_OR_RETURN(
                       ModelSummary summary,
                       engine_->DeleteModel(request->model_id()));
                   metrics_->RemoveModel(summary.model_id);
                   metrics_->SetModelCount(engine_->num_models());
                   ToProto(summary, response->mutable_model());
                   return absl::OkStatus();
                 });
}

grpc::ServerUnaryReactor* TrainerService::ForwardBackward(
    grpc::CallbackServerContext* context,
    const v1::ForwardBackwardRequest* request,
    v1::ForwardBackwardResponse* response) {
  auto args = std::make_shared<absl::StatusOr<ForwardBackwardArgs>>(
      ParseForwardBackward(*request));
  return Execute(
      "ForwardBackward", context, args->status(),
      [this, request, response, args]() -> absl::Status {
        const auto start = std::chrono::steady_clock::now();
        TALLY_ASSIGN_OR_RETURN(
            ForwardBackwardResult result,
            engine_->ForwardBackward(request->model_id(), **args));
        metrics_->RecordForwardBackward(request->model_id(), result,
                                        !(*args)->forward_only,
                                        SecondsSince(start));
        ToProto(result, response);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::OptimStep(
    grpc::CallbackServerContext* context, const v1::OptimStepRequest* request,
    v1::OptimStepResponse* response) {
  auto args = std::make_shared<absl::StatusOr<OptimStepArgs>>(
      ParseOptimStep(*request));
  return Execute("OptimStep", context, args->status(),
                 [this, request, response, args]() -> absl::Status {
                   const auto start = std::chrono::steady_clock::now();
                   TALLY_ASSIGN_OR_RETURN(
                       OptimStepResult result,
                       engine_->OptimStep(request->model_id(), **args));
                   metrics_->RecordOptimStep(request->model_id(), result,
                                             SecondsSince(start));
                   ToProto(result, response);
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
                   TALLY_ASSIGN_OR_RETURN(
                       WindowCounts discarded,
                       engine_->AbortAccumulation(request->model_id()));
                   metrics_->SetPendingTokens(request->model_id(), 0);
                   response->set_discarded_calls(discarded.calls);
                   response->set_discarded_tokens(discarded.tokens);
                   response->set_discarded_samples(discarded.samples);
                   response->set_discarded_reduction(
                       ToProto(discarded.reduction));
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
                   TALLY_ASSIGN_OR_RETURN(
                       SaveResult saved,
                       engine_->SaveCheckpoint(request->model_id(),
                                               request->path()));
                   response->set_path(saved.path);
                   response->set_step(saved.step);
                   response->set_bytes_written(saved.bytes_written);
                   return absl::OkStatus();
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
                   TALLY_ASSIGN_OR_RETURN(
                       LoadResult loaded,
                       engine_->LoadCheckpoint(request->model_id(),
                                               request->path(),
                                               request->load_optimizer()));
                   metrics_->SetPendingTokens(request->model_id(), 0);
                   ToProto(loaded.model, response->mutable_model());
                   response->set_discarded_calls(loaded.discarded.calls);
                   response->set_discarded_tokens(loaded.discarded.tokens);
                   response->set_discarded_samples(loaded.discarded.samples);
                   return absl::OkStatus();
                 });
}

}  // namespace tally
