#include "server/commands.h"

#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status.h"
#include "server/convert.h"

namespace tally {
namespace {

// The parse of a command whose execution reads its request alone.
template <typename Request>
absl::StatusOr<NoArgs> NothingToParse(const Request&) {
  return NoArgs();
}

absl::Status ExecuteCreateModel(Engine& engine, const v1::CreateModelRequest&,
                                const ModelSpec& spec, v1::ModelInfo* response,
                                const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(ModelSummary summary, engine.CreateModel(spec));
  ToProto(summary, response);
  return absl::OkStatus();
}

void RecordCreateModel(ServerMetrics& metrics, const Engine& engine,
                       const v1::CreateModelRequest& request,
                       const v1::ModelInfo& response,
                       const absl::Status& status, double) {
  if (!status.ok()) return;
  metrics.SetModelCount(engine.num_models());
  metrics.SetPendingTokens(CreatedModelId(request, response), 0);
}

absl::Status ExecuteDeleteModel(Engine& engine,
                                const v1::DeleteModelRequest& request,
                                const NoArgs&,
                                v1::DeleteModelResponse* response,
                                const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(ModelSummary summary,
                         engine.DeleteModel(request.model_id()));
  ToProto(summary, response->mutable_model());
  return absl::OkStatus();
}

void RecordDeleteModel(ServerMetrics& metrics, const Engine& engine,
                       const v1::DeleteModelRequest& request,
                       const v1::DeleteModelResponse&,
                       const absl::Status& status, double) {
  if (!status.ok()) return;
  metrics.RemoveModel(request.model_id());
  metrics.SetModelCount(engine.num_models());
}

absl::Status ExecuteForwardBackward(Engine& engine,
                                    const v1::ForwardBackwardRequest& request,
                                    const ForwardBackwardArgs& args,
                                    v1::ForwardBackwardResponse* response,
                                    const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult result,
                         engine.ForwardBackward(request.model_id(), args));
  ToProto(result, response);
  return absl::OkStatus();
}

void RecordForwardBackward(ServerMetrics& metrics, const Engine&,
                           const v1::ForwardBackwardRequest& request,
                           const v1::ForwardBackwardResponse& response,
                           const absl::Status& status, double seconds) {
  if (status.ok()) {
    metrics.RecordForwardBackward(request.model_id(), response,
                                  !request.forward_only(), request.reduction(),
                                  seconds);
  } else if (PoisonedTheWindow(status)) {
    metrics.RecordPoisonedWindow(request.model_id());
  }
}

absl::Status ExecuteOptimStep(Engine& engine,
                              const v1::OptimStepRequest& request,
                              const OptimStepArgs& args,
                              v1::OptimStepResponse* response,
                              const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(OptimStepResult result,
                         engine.OptimStep(request.model_id(), args));
  ToProto(result, response);
  return absl::OkStatus();
}

void RecordOptimStep(ServerMetrics& metrics, const Engine&,
                     const v1::OptimStepRequest& request,
                     const v1::OptimStepResponse& response,
                     const absl::Status& status, double seconds) {
  if (status.ok()) {
    metrics.RecordOptimStep(request.model_id(), response, seconds);
  } else if (PoisonedTheWindow(status)) {
    metrics.RecordPoisonedWindow(request.model_id());
  }
}

absl::Status ExecuteAbortAccumulation(
    Engine& engine, const v1::AbortAccumulationRequest& request, const NoArgs&,
    v1::AbortAccumulationResponse* response, const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(WindowCounts discarded,
                         engine.AbortAccumulation(request.model_id()));
  response->set_discarded_calls(discarded.calls);
  response->set_discarded_tokens(discarded.tokens);
  response->set_discarded_samples(discarded.samples);
  response->set_discarded_reduction(ToProto(discarded.reduction));
  return absl::OkStatus();
}

void RecordAbortAccumulation(ServerMetrics& metrics, const Engine&,
                             const v1::AbortAccumulationRequest& request,
                             const v1::AbortAccumulationResponse&,
                             const absl::Status& status, double) {
  if (status.ok()) metrics.SetPendingTokens(request.model_id(), 0);
}

// Records a run of a command that writes a directory as a checkpoint
// operation of `kKind` (ServerMetrics::RecordCheckpoint).
template <const char* kKind, typename Request, typename Response>
void RecordWrite(ServerMetrics& metrics, const Engine&, const Request&,
                 const Response&, const absl::Status& status, double seconds) {
  metrics.RecordCheckpoint(kKind, status.ok(), seconds);
}
constexpr char kSaveKind[] = "save";
constexpr char kExportKind[] = "export";

absl::Status ExecuteExportWeights(Engine& engine,
                                  const v1::ExportWeightsRequest& request,
                                  const ExportOptions& options,
                                  v1::ExportWeightsResponse* response,
                                  const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(
      ExportResult exported,
      engine.ExportWeights(request.model_id(), request.path(), options));
  response->set_path(exported.path);
  response->set_bytes_written(exported.bytes_written);
  for (const std::string& file : exported.files) response->add_files(file);
  return absl::OkStatus();
}

void ToProto(const PromptLogprobs& prompt, v1::PromptLogprobs* out) {
  out->mutable_logprobs()->Add(prompt.logprobs.begin(), prompt.logprobs.end());
  for (const TopkLogprobs& position : prompt.topk) {
    v1::TopkLogprobs* topk = out->add_topk();
    for (int64_t token : position.tokens) {
      topk->add_tokens(static_cast<int32_t>(token));
    }
    topk->mutable_logprobs()->Add(position.logprobs.begin(),
                                  position.logprobs.end());
  }
}

absl::Status ExecuteSample(Engine& engine, const v1::SampleRequest& request,
                           const SampleArgs& args, v1::SampleResponse* response,
                           const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(
      SampleCallResult result,
      engine.Sample(request.model_id(), args, request.sampler()));
  for (const DecodedSequence& sequence : result.sequences) {
    v1::SampledSequence* out = response->add_sequences();
    for (int64_t token : sequence.tokens) {
      out->add_tokens(static_cast<int32_t>(token));
    }
    out->mutable_logprobs()->Add(sequence.logprobs.begin(),
                                 sequence.logprobs.end());
    out->set_stop_reason(sequence.stop_reason == StopReason::kStop
                             ? v1::STOP_REASON_STOP
                             : v1::STOP_REASON_LENGTH);
  }
  for (const PromptLogprobs& prompt : result.prompt_logprobs) {
    ToProto(prompt, response->add_prompt_logprobs());
  }
  response->set_seed(result.seed);
  response->set_step(result.step);
  return absl::OkStatus();
}

void RecordSample(ServerMetrics& metrics, const Engine&,
                  const v1::SampleRequest& request,
                  const v1::SampleResponse& response,
                  const absl::Status& status, double seconds) {
  if (!status.ok()) return;
  int64_t tokens = 0;
  for (const v1::SampledSequence& sequence : response.sequences()) {
    tokens += sequence.tokens_size();
  }
  metrics.RecordSample(request.model_id(), tokens, seconds);
}

absl::Status ExecuteComputeLogprobs(Engine& engine,
                                    const v1::ComputeLogprobsRequest& request,
                                    const LogprobsArgs& args,
                                    v1::ComputeLogprobsResponse* response,
                                    const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(
      LogprobsCallResult result,
      engine.ComputeLogprobs(request.model_id(), args, request.sampler()));
  for (const PromptLogprobs& prompt : result.prompts) {
    ToProto(prompt, response->add_prompts());
  }
  response->set_step(result.step);
  return absl::OkStatus();
}

// The parse of a sampler command: its name (ValidateSamplerRequest).
template <typename Request>
absl::StatusOr<NoArgs> ParseSamplerName(const Request& request) {
  TALLY_RETURN_IF_ERROR(ValidateSamplerRequest(request));
  return NoArgs();
}

absl::Status ExecuteSaveWeightsForSampler(
    Engine& engine, const v1::SaveWeightsForSamplerRequest& request,
    const NoArgs&, v1::SamplerInfo* response, const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(
      SamplerSummary saved,
      engine.SaveWeightsForSampler(request.model_id(), request.name()));
  ToProto(saved, response);
  return absl::OkStatus();
}

absl::Status ExecuteDeleteSampler(Engine& engine,
                                  const v1::DeleteSamplerRequest& request,
                                  const NoArgs&, v1::SamplerInfo* response,
                                  const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(
      SamplerSummary deleted,
      engine.DeleteSampler(request.model_id(), request.name()));
  ToProto(deleted, response);
  return absl::OkStatus();
}

// Sampler commands record nothing of their own (the RPC counters count
// them).
template <typename Request>
void RecordNothing(ServerMetrics&, const Engine&, const Request&,
                   const v1::SamplerInfo&, const absl::Status&, double) {}

void RecordLoadCheckpoint(ServerMetrics& metrics, const Engine&,
                          const v1::LoadCheckpointRequest& request,
                          const v1::LoadCheckpointResponse&,
                          const absl::Status& status, double seconds) {
  metrics.RecordCheckpoint("load", status.ok(), seconds);
  if (status.ok()) metrics.SetPendingTokens(request.model_id(), 0);
}

absl::Status ExecutePoisonWindow(
    Engine& engine, const v1::internal::PoisonWindowCommand& request,
    const NoArgs&, bool* poisoned, const RankZeroData&) {
  TALLY_ASSIGN_OR_RETURN(
      *poisoned, engine.PoisonWindow(request.model_id(), request.reason()));
  return absl::OkStatus();
}

void RecordPoisonWindow(ServerMetrics& metrics, const Engine&,
                        const v1::internal::PoisonWindowCommand& request,
                        const bool& poisoned, const absl::Status& status,
                        double) {
  if (status.ok() && poisoned) metrics.RecordPoisonedWindow(request.model_id());
}

}  // namespace

constexpr CommandSpec<v1::CreateModelRequest, ModelSpec, v1::ModelInfo>
    kCreateModelCommand = {Command::kCreateModel, &ParseCreateModel,
                           &ExecuteCreateModel, &RecordCreateModel,
                           /*observe_seconds=*/nullptr};
constexpr CommandSpec<v1::DeleteModelRequest, NoArgs, v1::DeleteModelResponse>
    kDeleteModelCommand = {Command::kDeleteModel,
                           &NothingToParse<v1::DeleteModelRequest>,
                           &ExecuteDeleteModel, &RecordDeleteModel,
                           /*observe_seconds=*/nullptr};
constexpr CommandSpec<v1::ForwardBackwardRequest, ForwardBackwardArgs,
                      v1::ForwardBackwardResponse>
    kForwardBackwardCommand = {Command::kForwardBackward, &ParseForwardBackward,
                               &ExecuteForwardBackward, &RecordForwardBackward,
                               &ServerMetrics::ObserveForwardBackwardSeconds};
constexpr CommandSpec<v1::OptimStepRequest, OptimStepArgs,
                      v1::OptimStepResponse>
    kOptimStepCommand = {Command::kOptimStep, &ParseOptimStep,
                         &ExecuteOptimStep, &RecordOptimStep,
                         &ServerMetrics::ObserveOptimStepSeconds};
constexpr CommandSpec<v1::AbortAccumulationRequest, NoArgs,
                      v1::AbortAccumulationResponse>
    kAbortAccumulationCommand = {Command::kAbortAccumulation,
                                 &NothingToParse<v1::AbortAccumulationRequest>,
                                 &ExecuteAbortAccumulation,
                                 &RecordAbortAccumulation,
                                 /*observe_seconds=*/nullptr};
constexpr CommandSpec<v1::SaveCheckpointRequest, NoArgs,
                      v1::SaveCheckpointResponse>
    kSaveCheckpointCommand = {
        Command::kSaveCheckpoint, &NothingToParse<v1::SaveCheckpointRequest>,
        [](Engine& engine, const v1::SaveCheckpointRequest& request,
           const NoArgs&, v1::SaveCheckpointResponse* response,
           const RankZeroData& rank_zero) {
          return ExecuteSaveCheckpoint(engine, request, response,
                                       rank_zero.server_state);
        },
        &RecordWrite<kSaveKind, v1::SaveCheckpointRequest,
                     v1::SaveCheckpointResponse>,
        /*observe_seconds=*/nullptr};
constexpr CommandSpec<v1::LoadCheckpointRequest, NoArgs,
                      v1::LoadCheckpointResponse>
    kLoadCheckpointCommand = {
        Command::kLoadCheckpoint, &NothingToParse<v1::LoadCheckpointRequest>,
        [](Engine& engine, const v1::LoadCheckpointRequest& request,
           const NoArgs&, v1::LoadCheckpointResponse* response,
           const RankZeroData& rank_zero) {
          return ExecuteLoadCheckpoint(engine, request, response,
                                       rank_zero.loaded);
        },
        &RecordLoadCheckpoint, /*observe_seconds=*/nullptr};
constexpr CommandSpec<v1::ExportWeightsRequest, ExportOptions,
                      v1::ExportWeightsResponse>
    kExportWeightsCommand = {Command::kExportWeights, &ParseExportWeights,
                             &ExecuteExportWeights,
                             &RecordWrite<kExportKind, v1::ExportWeightsRequest,
                                          v1::ExportWeightsResponse>,
                             /*observe_seconds=*/nullptr};
constexpr CommandSpec<v1::SampleRequest, SampleArgs, v1::SampleResponse>
    kSampleCommand = {Command::kSample, &ParseSample, &ExecuteSample,
                      &RecordSample, &ServerMetrics::ObserveSampleSeconds};
constexpr CommandSpec<v1::ComputeLogprobsRequest, LogprobsArgs,
                      v1::ComputeLogprobsResponse>
    kComputeLogprobsCommand = {
        Command::kComputeLogprobs, &ParseComputeLogprobs,
        &ExecuteComputeLogprobs,
        [](ServerMetrics&, const Engine&, const v1::ComputeLogprobsRequest&,
           const v1::ComputeLogprobsResponse&, const absl::Status&, double) {},
        /*observe_seconds=*/nullptr};
constexpr CommandSpec<v1::SaveWeightsForSamplerRequest, NoArgs, v1::SamplerInfo>
    kSaveWeightsForSamplerCommand = {
        Command::kSaveWeightsForSampler,
        &ParseSamplerName<v1::SaveWeightsForSamplerRequest>,
        &ExecuteSaveWeightsForSampler,
        &RecordNothing<v1::SaveWeightsForSamplerRequest>,
        /*observe_seconds=*/nullptr};
constexpr CommandSpec<v1::DeleteSamplerRequest, NoArgs, v1::SamplerInfo>
    kDeleteSamplerCommand = {
        Command::kDeleteSampler, &ParseSamplerName<v1::DeleteSamplerRequest>,
        &ExecuteDeleteSampler, &RecordNothing<v1::DeleteSamplerRequest>,
        /*observe_seconds=*/nullptr};
constexpr CommandSpec<v1::internal::PoisonWindowCommand, NoArgs, bool>
    kPoisonWindowCommand = {Command::kPoisonWindow,
                            &NothingToParse<v1::internal::PoisonWindowCommand>,
                            &ExecutePoisonWindow, &RecordPoisonWindow,
                            /*observe_seconds=*/nullptr};

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

absl::Status PoisonDroppedWindow(Communicator& control, Engine& engine,
                                 const std::string& model_id,
                                 const WindowCounts& dropped,
                                 absl::string_view cause) {
  if (dropped.calls == 0) return absl::OkStatus();
  v1::internal::PoisonWindowCommand poison;
  poison.set_model_id(model_id);
  poison.set_reason(
      absl::StrCat(cause, " a checkpoint that dropped ", dropped.calls,
                   " pending ForwardBackward calls of this window"));
  bool poisoned = false;
  return CommandRunner(control, engine, /*metrics=*/nullptr)
      .Run(kPoisonWindowCommand, poison, &poisoned);
}

namespace {

// The command table as ranks > 0 read it: every entry behind one signature.
struct ReplicaEntry {
  Command command;
  // Parses `payload` as the entry's request, and that into its arguments,
  // and executes it on this rank;
  // `model_id` gets the request's.
  absl::Status (*run)(Engine& engine, const std::string& payload,
                      std::string* model_id);
  void (ServerMetrics::*observe_seconds)(const std::string& model_id,
                                         double seconds);
};

template <const auto& kSpec>
absl::Status RunReplica(Engine& engine, const std::string& payload,
                        std::string* model_id) {
  using Spec = std::decay_t<decltype(kSpec)>;
  typename Spec::Request request;
  if (!request.ParseFromString(payload)) {
    return absl::DataLossError("cannot parse a replicated command");
  }
  *model_id = request.model_id();
  typename Spec::Response response{};
  bool threw = true;
  absl::Status status = CatchTorch("a replicated command", [&] {
    const absl::StatusOr<typename Spec::Args> args = kSpec.parse(request);
    absl::Status executed = args.ok() ? kSpec.execute(engine, request, *args,
                                                      &response, RankZeroData())
                                      : args.status();
    threw = false;
    return executed;
  });
  if (threw && !model_id->empty()) {
    // The window may hold part of the call: never step on it silently.
    engine.PoisonWindow(*model_id, std::string(status.message()))
        .status()
        .IgnoreError();
  }
  return status;
}

template <const auto& kSpec>
constexpr ReplicaEntry ReplicaEntryOf() {
  return {kSpec.command, &RunReplica<kSpec>, kSpec.observe_seconds};
}

constexpr ReplicaEntry kCommandTable[] = {
    ReplicaEntryOf<kCreateModelCommand>(),
    ReplicaEntryOf<kDeleteModelCommand>(),
    ReplicaEntryOf<kForwardBackwardCommand>(),
    ReplicaEntryOf<kOptimStepCommand>(),
    ReplicaEntryOf<kAbortAccumulationCommand>(),
    ReplicaEntryOf<kSaveCheckpointCommand>(),
    ReplicaEntryOf<kLoadCheckpointCommand>(),
    ReplicaEntryOf<kPoisonWindowCommand>(),
    ReplicaEntryOf<kExportWeightsCommand>(),
    ReplicaEntryOf<kSampleCommand>(),
    ReplicaEntryOf<kComputeLogprobsCommand>(),
    ReplicaEntryOf<kSaveWeightsForSamplerCommand>(),
    ReplicaEntryOf<kDeleteSamplerCommand>(),
};

const ReplicaEntry* FindReplicaEntry(Command command) {
  for (const ReplicaEntry& entry : kCommandTable) {
    if (entry.command == command) return &entry;
  }
  return nullptr;
}

// Receives the next (command, payload) from rank 0.
absl::Status ReceiveCommand(Communicator& control, Command* command,
                            std::string* payload) {
  torch::Tensor header = torch::zeros({2}, torch::kInt64);
  TALLY_RETURN_IF_ERROR(control.Broadcast(header, /*root=*/0));
  *command = static_cast<Command>(header[0].item<int64_t>());
  payload->assign(static_cast<size_t>(header[1].item<int64_t>()), '\0');
  if (payload->empty()) return absl::OkStatus();
  torch::Tensor bytes = torch::from_blob(
      payload->data(), {static_cast<int64_t>(payload->size())}, torch::kUInt8);
  return control.Broadcast(bytes, /*root=*/0);
}

}  // namespace

absl::Status CommandLoop(Engine& engine, Communicator& control,
                         ServerMetrics* metrics, ProgressWatch* progress) {
  while (true) {
    Command command = Command::kShutdown;
    std::string payload;
    TALLY_RETURN_IF_ERROR(ReceiveCommand(control, &command, &payload));
    if (command == Command::kShutdown) return absl::OkStatus();
    const ReplicaEntry* entry = FindReplicaEntry(command);
    if (entry == nullptr) {
      return absl::DataLossError(absl::StrCat("unknown replicated command ",
                                              static_cast<int64_t>(command)));
    }
    const absl::Time start = absl::Now();
    std::string model_id;
    absl::Status status;
    {
      ProgressWatch::Scope running(progress);
      status = entry->run(engine, payload, &model_id);
    }
    if (metrics != nullptr) {
      if (status.ok() && entry->observe_seconds != nullptr) {
        (metrics->*entry->observe_seconds)(
            model_id, absl::ToDoubleSeconds(absl::Now() - start));
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
