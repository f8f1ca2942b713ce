#include "server/commands.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status.h"
#include "server/convert.h"

namespace tally {

absl::Status ExecuteCreateModel(Engine& engine,
                                const v1::CreateModelRequest& request,
                                v1::ModelInfo* response) {
  TALLY_ASSIGN_OR_RETURN(ModelSpec spec, ParseCreateModel(request));
  TALLY_ASSIGN_OR_RETURN(ModelSummary summary, engine.CreateModel(spec));
  ToProto(summary, response);
  return absl::OkStatus();
}

absl::Status ExecuteDeleteModel(Engine& engine,
                                const v1::DeleteModelRequest& request,
                                v1::DeleteModelResponse* response) {
  TALLY_ASSIGN_OR_RETURN(ModelSummary summary,
                         engine.DeleteModel(request.model_id()));
  ToProto(summary, response->mutable_model());
  return absl::OkStatus();
}

absl::Status ExecuteForwardBackward(Engine& engine,
                                    const v1::ForwardBackwardRequest& request,
                                    v1::ForwardBackwardResponse* response) {
  TALLY_ASSIGN_OR_RETURN(ForwardBackwardArgs args,
                         ParseForwardBackward(request));
  TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult result,
                         engine.ForwardBackward(request.model_id(), args));
  ToProto(result, response);
  return absl::OkStatus();
}

absl::Status ExecuteOptimStep(Engine& engine,
                              const v1::OptimStepRequest& request,
                              v1::OptimStepResponse* response) {
  TALLY_ASSIGN_OR_RETURN(OptimStepArgs args, ParseOptimStep(request));
  TALLY_ASSIGN_OR_RETURN(OptimStepResult result,
                         engine.OptimStep(request.model_id(), args));
  ToProto(result, response);
  return absl::OkStatus();
}

absl::Status ExecuteAbortAccumulation(
    Engine& engine, const v1::AbortAccumulationRequest& request,
    v1::AbortAccumulationResponse* response) {
  TALLY_ASSIGN_OR_RETURN(WindowCounts discarded,
                         engine.AbortAccumulation(request.model_id()));
  response->set_discarded_calls(discarded.calls);
  response->set_discarded_tokens(discarded.tokens);
  response->set_discarded_samples(discarded.samples);
  response->set_discarded_reduction(ToProto(discarded.reduction));
  return absl::OkStatus();
}

absl::Status ExecuteSaveCheckpoint(Engine& engine,
                                   const v1::SaveCheckpointRequest& request,
                                   v1::SaveCheckpointResponse* response,
                                   const std::string& server_state) {
  SaveOptions options;
  options.allow_pending = request.allow_pending();
  options.server_state = server_state;
  TALLY_ASSIGN_OR_RETURN(
      SaveResult saved,
      engine.SaveCheckpoint(request.model_id(), request.path(), options));
  response->set_path(saved.path);
  response->set_step(saved.step);
  response->set_bytes_written(saved.bytes_written);
  response->set_unsaved_calls(saved.unsaved_window.calls);
  response->set_unsaved_tokens(saved.unsaved_window.tokens);
  response->set_unsaved_samples(saved.unsaved_window.samples);
  return absl::OkStatus();
}

absl::Status ExecuteLoadCheckpoint(Engine& engine,
                                   const v1::LoadCheckpointRequest& request,
                                   v1::LoadCheckpointResponse* response,
                                   LoadResult* loaded_out) {
  TALLY_ASSIGN_OR_RETURN(
      LoadResult loaded,
      engine.LoadCheckpoint(request.model_id(), request.path(),
                            request.load_optimizer()));
  ToProto(loaded.model, response->mutable_model());
  response->set_discarded_calls(loaded.discarded.calls);
  response->set_discarded_tokens(loaded.discarded.tokens);
  response->set_discarded_samples(loaded.discarded.samples);
  if (loaded_out != nullptr) *loaded_out = std::move(loaded);
  return absl::OkStatus();
}

absl::Status ExecutePoisonWindow(Engine& engine,
                                 const v1::GetModelRequest& request,
                                 v1::ModelInfo* response,
                                 const std::string& reason) {
  TALLY_RETURN_IF_ERROR(engine.PoisonWindow(request.model_id(), reason));
  TALLY_ASSIGN_OR_RETURN(ModelSummary summary,
                         engine.GetModel(request.model_id()));
  ToProto(summary, response);
  return absl::OkStatus();
}

absl::Status PoisonDroppedWindow(Communicator& control, Engine& engine,
                                 const std::string& model_id,
                                 const WindowCounts& dropped,
                                 absl::string_view cause) {
  if (dropped.calls == 0) return absl::OkStatus();
  v1::GetModelRequest poison;
  poison.set_model_id(model_id);
  TALLY_RETURN_IF_ERROR(
      ReplicateCommand(control, Command::kPoisonWindow, poison));
  v1::ModelInfo poisoned;
  return ExecutePoisonWindow(
      engine, poison, &poisoned,
      absl::StrCat(cause, " a checkpoint that dropped ", dropped.calls,
                   " pending ForwardBackward calls of this window"));
}

absl::Status ReplicateCommand(Communicator& control, Command command,
                              const google::protobuf::Message& request) {
  if (control.size() == 1) return absl::OkStatus();
  std::string payload;
  if (!request.SerializeToString(&payload)) {
    return absl::InternalError("cannot serialize the command");
  }
  torch::Tensor header = torch::tensor(
      {static_cast<int64_t>(command), static_cast<int64_t>(payload.size())},
      torch::kInt64);
  TALLY_RETURN_IF_ERROR(control.Broadcast(header, /*root=*/0));
  if (payload.empty()) return absl::OkStatus();
  torch::Tensor bytes = torch::from_blob(
      payload.data(), {static_cast<int64_t>(payload.size())}, torch::kUInt8);
  return control.Broadcast(bytes, /*root=*/0);
}

namespace {

// Parses the payload as `Request` and runs `execute` on it; `model_id` gets
// the request's model id.
template <typename Request, typename Response>
absl::Status Run(Engine& engine, const std::string& payload,
                 absl::Status (*execute)(Engine&, const Request&, Response*),
                 std::string* model_id) {
  Request request;
  if (!request.ParseFromString(payload)) {
    return absl::DataLossError("cannot parse a replicated command");
  }
  *model_id = request.model_id();
  Response response;
  bool threw = true;
  absl::Status status = CatchTorch("a replicated command", [&] {
    absl::Status executed = execute(engine, request, &response);
    threw = false;
    return executed;
  });
  if (threw && !model_id->empty()) {
    // The window may hold part of the call: never step on it silently.
    engine.PoisonWindow(*model_id, std::string(status.message())).IgnoreError();
  }
  return status;
}

}  // namespace

absl::Status CommandLoop(Engine& engine, Communicator& control,
                         ServerMetrics* metrics) {
  while (true) {
    torch::Tensor header = torch::zeros({2}, torch::kInt64);
    TALLY_RETURN_IF_ERROR(control.Broadcast(header, /*root=*/0));
    const auto command = static_cast<Command>(header[0].item<int64_t>());
    std::string payload(static_cast<size_t>(header[1].item<int64_t>()), '\0');
    if (!payload.empty()) {
      torch::Tensor bytes = torch::from_blob(
          payload.data(), {static_cast<int64_t>(payload.size())},
          torch::kUInt8);
      TALLY_RETURN_IF_ERROR(control.Broadcast(bytes, /*root=*/0));
    }
    absl::Status status;
    std::string model_id;
    const auto start = std::chrono::steady_clock::now();
    switch (command) {
      case Command::kShutdown:
        return absl::OkStatus();
      case Command::kCreateModel:
        status = Run(engine, payload, &ExecuteCreateModel, &model_id);
        break;
      case Command::kDeleteModel:
        status = Run(engine, payload, &ExecuteDeleteModel, &model_id);
        break;
      case Command::kForwardBackward:
        status = Run(engine, payload, &ExecuteForwardBackward, &model_id);
        break;
      case Command::kOptimStep:
        status = Run(engine, payload, &ExecuteOptimStep, &model_id);
        break;
      case Command::kAbortAccumulation:
        status = Run(engine, payload, &ExecuteAbortAccumulation, &model_id);
        break;
      case Command::kSaveCheckpoint:
        // Only rank 0 writes, so the server state is rank 0's to pass.
        status = Run<v1::SaveCheckpointRequest, v1::SaveCheckpointResponse>(
            engine, payload,
            [](Engine& e, const v1::SaveCheckpointRequest& request,
               v1::SaveCheckpointResponse* response) {
              return ExecuteSaveCheckpoint(e, request, response);
            },
            &model_id);
        break;
      case Command::kLoadCheckpoint:
        status = Run<v1::LoadCheckpointRequest, v1::LoadCheckpointResponse>(
            engine, payload,
            [](Engine& e, const v1::LoadCheckpointRequest& request,
               v1::LoadCheckpointResponse* response) {
              return ExecuteLoadCheckpoint(e, request, response);
            },
            &model_id);
        break;
      case Command::kPoisonWindow:
        status = Run<v1::GetModelRequest, v1::ModelInfo>(
            engine, payload,
            [](Engine& e, const v1::GetModelRequest& request,
               v1::ModelInfo* response) {
              return ExecutePoisonWindow(e, request, response,
                                         "rank 0 poisoned the window");
            },
            &model_id);
        break;
      default:
        return absl::DataLossError(absl::StrCat("unknown replicated command ",
                                                static_cast<int64_t>(command)));
    }
    if (metrics != nullptr) {
      const double seconds = std::chrono::duration<double>(
                                 std::chrono::steady_clock::now() - start)
                                 .count();
      if (status.ok() && command == Command::kForwardBackward) {
        metrics->ObserveForwardBackwardSeconds(model_id, seconds);
      } else if (status.ok() && command == Command::kOptimStep) {
        metrics->ObserveOptimStepSeconds(model_id, seconds);
      } else {
        metrics->RecordRankState();
      }
    }
    // This rank's groups are unusable: exit so the supervisor restarts the
    // deployment.
    TALLY_RETURN_IF_ERROR(engine.CollectiveFailure());
    if (!status.ok()) {
      // Rejected requests are the client's business (rank 0 answers them);
      // anything else is worth a look on this rank too.
      const bool rejected =
          absl::IsInvalidArgument(status) || absl::IsNotFound(status) ||
          absl::IsAlreadyExists(status) || absl::IsFailedPrecondition(status);
      Log(rejected ? LogLevel::kDebug : LogLevel::kWarning,
          absl::StrCat("replicated command failed: ", status.ToString()));
    }
  }
}

}  // namespace tally
