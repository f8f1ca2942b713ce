#include "server/trainer_service.h"

#include <chrono>
#include <filesystem>
#include <memory>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "runtime/checkpoint.h"
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

// `first` unless it is OK, then `second`.
absl::Status FirstError(absl::Status first, const absl::Status& second) {
  first.Update(second);
  return first;
}

// gRPC hands each request to this call alone; rewriting it in place (tenant
// scope, confined path) lets every later stage see the server's form of it.
template <typename Request>
Request* Mutable(const Request* request) {
  return const_cast<Request*>(request);
}

}  // namespace

absl::StatusOr<std::string> TrainerService::Authenticate(
    const grpc::CallbackServerContext& context) {
  if (options_.authenticator == nullptr) return std::string();
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) return options_.authenticator->Authenticate({});
  return options_.authenticator->Authenticate(
      absl::string_view(it->second.data(), it->second.size()));
}

absl::Status TrainerService::ConfinePath(
    const grpc::CallbackServerContext& context, std::string* path) {
  if (options_.checkpoint_root.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> tenant = Authenticate(context);
  if (!tenant.ok()) return absl::OkStatus();  // Execute refuses the call
  std::string root = options_.checkpoint_root;
  if (!tenant->empty()) {
    root = absl::StrCat(root, "/", *tenant);
    std::error_code error;
    std::filesystem::create_directories(root, error);
  }
  TALLY_ASSIGN_OR_RETURN(*path, ConfineToRoot(root, *path));
  return absl::OkStatus();
}

void TrainerService::Finish(const char* method,
                            grpc::ServerUnaryReactor* reactor,
                            const absl::Status& status) {
  metrics_->RecordRequest(method, absl::StatusCodeToString(status.code()));
  reactor->Finish(ToGrpc(status));
}

grpc::ServerUnaryReactor* TrainerService::Execute(
    const char* method, grpc::CallbackServerContext* context,
    absl::Status validation, std::function<absl::Status()> command,
    std::string* model_id) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::StatusOr<std::string> tenant = Authenticate(*context);
  if (!tenant.ok()) {
    metrics_->RecordAuthFailure(
        context->client_metadata().count("authorization") ? "invalid_token"
                                                          : "missing_token");
    Finish(method, reactor, tenant.status());
    return reactor;
  }
  if (!validation.ok()) {
    Finish(method, reactor, validation);
    return reactor;
  }
  if (model_id != nullptr) *model_id = ScopedModelId(*tenant, *model_id);
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
  absl::Status validation = FirstError(
      request->model_id().empty() ? absl::OkStatus()
                                  : ValidateModelId(request->model_id()),
      ParseCreateModel(*request).status());
  if (validation.ok() && !request->init_checkpoint().empty()) {
    validation =
        ConfinePath(*context, Mutable(request)->mutable_init_checkpoint());
  }
  return Execute(
      "CreateModel", context, validation,
      [this, request, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(
            ReplicateCommand(*control_, Command::kCreateModel, *request));
        TALLY_RETURN_IF_ERROR(ExecuteCreateModel(*engine_, *request, response));
        metrics_->SetModelCount(engine_->num_models());
        // An empty id (or a tenant scope alone) was assigned by the engine.
        std::string engine_id = request->model_id();
        if (engine_id.empty() || engine_id.back() == '/') {
          engine_id += response->model_id();
        }
        metrics_->SetPendingTokens(engine_id, 0);
        return absl::OkStatus();
      },
      Mutable(request)->mutable_model_id());
}

grpc::ServerUnaryReactor* TrainerService::GetModel(
    grpc::CallbackServerContext* context, const v1::GetModelRequest* request,
    v1::ModelInfo* response) {
  return Execute(
      "GetModel", context, ValidateModelId(request->model_id()),
      [this, request, response]() -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(ModelSummary summary,
                               engine_->GetModel(request->model_id()));
        ToProto(summary, response);
        return absl::OkStatus();
      },
      Mutable(request)->mutable_model_id());
}

grpc::ServerUnaryReactor* TrainerService::ListModels(
    grpc::CallbackServerContext* context, const v1::ListModelsRequest* request,
    v1::ListModelsResponse* response) {
  // A tenant lists its own models only (Execute refuses bad credentials).
  const std::string tenant = Authenticate(*context).value_or("");
  return Execute("ListModels", context, absl::OkStatus(),
                 [this, response, tenant]() -> absl::Status {
                   for (const ModelSummary& s : engine_->ListModels()) {
                     if (InTenant(s.model_id, tenant)) {
                       ToProto(s, response->add_models());
                     }
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
      },
      Mutable(request)->mutable_model_id());
}

grpc::ServerUnaryReactor* TrainerService::ForwardBackward(
    grpc::CallbackServerContext* context,
    const v1::ForwardBackwardRequest* request,
    v1::ForwardBackwardResponse* response) {
  return Execute(
      "ForwardBackward", context,
      FirstError(ValidateModelId(request->model_id()),
                 ParseForwardBackward(*request).status()),
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
      },
      Mutable(request)->mutable_model_id());
}

grpc::ServerUnaryReactor* TrainerService::OptimStep(
    grpc::CallbackServerContext* context, const v1::OptimStepRequest* request,
    v1::OptimStepResponse* response) {
  return Execute(
      "OptimStep", context,
      FirstError(ValidateModelId(request->model_id()),
                 ParseOptimStep(*request).status()),
      [this, request, response]() -> absl::Status {
        const auto start = std::chrono::steady_clock::now();
        TALLY_RETURN_IF_ERROR(
            ReplicateCommand(*control_, Command::kOptimStep, *request));
        TALLY_RETURN_IF_ERROR(ExecuteOptimStep(*engine_, *request, response));
        metrics_->RecordOptimStep(request->model_id(), *response,
                                  SecondsSince(start));
        if (options_.checkpointer != nullptr) {
          options_.checkpointer->AfterOptimStep(request->model_id(), *response);
        }
        return absl::OkStatus();
      },
      Mutable(request)->mutable_model_id());
}

grpc::ServerUnaryReactor* TrainerService::AbortAccumulation(
    grpc::CallbackServerContext* context,
    const v1::AbortAccumulationRequest* request,
    v1::AbortAccumulationResponse* response) {
  return Execute(
      "AbortAccumulation", context, ValidateModelId(request->model_id()),
      [this, request, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(
            ReplicateCommand(*control_, Command::kAbortAccumulation, *request));
        TALLY_RETURN_IF_ERROR(
            ExecuteAbortAccumulation(*engine_, *request, response));
        metrics_->SetPendingTokens(request->model_id(), 0);
        return absl::OkStatus();
      },
      Mutable(request)->mutable_model_id());
}

grpc::ServerUnaryReactor* TrainerService::SaveCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::SaveCheckpointRequest* request,
    v1::SaveCheckpointResponse* response) {
  absl::Status validation = ValidateModelId(request->model_id());
  if (validation.ok()) validation = ValidateCheckpointPath(request->path());
  if (validation.ok()) {
    validation = ConfinePath(*context, Mutable(request)->mutable_path());
  }
  return Execute(
      "SaveCheckpoint", context, validation,
      [this, request, response]() -> absl::Status {
        const auto start = std::chrono::steady_clock::now();
        absl::Status status =
            ReplicateCommand(*control_, Command::kSaveCheckpoint, *request);
        if (status.ok()) {
          status = ExecuteSaveCheckpoint(*engine_, *request, response);
        }
        metrics_->RecordCheckpoint("save", status.ok(), SecondsSince(start));
        return status;
      },
      Mutable(request)->mutable_model_id());
}

grpc::ServerUnaryReactor* TrainerService::LoadCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::LoadCheckpointRequest* request,
    v1::LoadCheckpointResponse* response) {
  absl::Status validation = ValidateModelId(request->model_id());
  if (validation.ok()) validation = ValidateCheckpointPath(request->path());
  if (validation.ok()) {
    validation = ConfinePath(*context, Mutable(request)->mutable_path());
  }
  return Execute(
      "LoadCheckpoint", context, validation,
      [this, request, response]() -> absl::Status {
        const auto start = std::chrono::steady_clock::now();
        absl::Status status =
            ReplicateCommand(*control_, Command::kLoadCheckpoint, *request);
        if (status.ok()) {
          status = ExecuteLoadCheckpoint(*engine_, *request, response);
        }
        metrics_->RecordCheckpoint("load", status.ok(), SecondsSince(start));
        TALLY_RETURN_IF_ERROR(status);
        metrics_->SetPendingTokens(request->model_id(), 0);
        return absl::OkStatus();
      },
      Mutable(request)->mutable_model_id());
}

}  // namespace tally
