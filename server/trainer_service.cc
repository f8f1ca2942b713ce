#include "server/trainer_service.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <system_error>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/error_reason.h"
#include "base/log.h"
#include "base/status.h"
#include "proto/grpc_status.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/directory_identity.h"
#include "runtime/config/memory_estimate.h"
#include "runtime/model/llama_model.h"
#include "server/adapter_state.h"
#include "server/artifact_download.h"
#include "server/cancellable_reactor.h"
#include "server/commands.h"
#include "server/convert.h"
#include "server/models_root.h"
#include "server/path_confinement.h"
#include "server/response_bound.h"
#include "server/server_info.h"

namespace tally {
namespace {

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

// The reason a window is poisoned for when a sequenced request of it never
// arrived (the Sequencer's gap timeout).
constexpr char kGapPoisonReason[] =
    "a sequenced request of the window did not arrive within "
    "--seq-gap-timeout";

// What a request that had not started when the server stopped gets.
absl::Status StoppedBeforeRunning() {
  return ReasonError(ErrorReason::kShuttingDown,
                     "the server is shutting down before this request ran; "
                     "retry it on the restarted server");
}

// Why the caller of `context` no longer waits for the answer (its deadline
// passed, or it cancelled); OK while it does.
absl::Status CallerGaveUp(grpc::CallbackServerContext* context) {
  if (context->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError(
        "the deadline passed before the request ran");
  }
  if (context->IsCancelled()) {
    return absl::CancelledError("cancelled by the client before it ran");
  }
  return absl::OkStatus();
}

// `first` unless it is OK, then `second`.
absl::Status FirstError(absl::Status first, const absl::Status& second) {
  first.Update(second);
  return first;
}

}  // namespace

namespace {

// `options` with its observers reporting to `metrics`.
MemoryAdmissionOptions ObservedBy(MemoryAdmissionOptions options,
                                  ServerMetrics* metrics) {
  options.on_resident = [metrics](double bytes) {
    metrics->SetMemoryAdmitted(bytes);
  };
  options.on_refusal = [metrics](const char* refused) {
    metrics->RecordMemoryRefusal(refused);
  };
  return options;
}

}  // namespace

TrainerService::TrainerService(Engine* engine, CommandExecutor* executor,
                               ServerMetrics* metrics,
                               TrainerServiceOptions options)
    : engine_(engine),
      executor_(executor),
      metrics_(metrics),
      commands_(engine->control(), *engine, metrics),
      options_(std::move(options)),
      scheduler_(
          RequestSchedulerOptions{options_.sequencing, options_.budget},
          executor,
          RequestSchedulerHooks{
              [metrics](size_t held) { metrics->SetQueueDepth(held); },
              [this](const std::string& model_id, const std::string& what) {
                PoisonNow(model_id,
                          absl::StrCat("a request of the window failed with "
                                       "an internal error (",
                                       what, ")"));
              },
              [this](const std::string& model_id) { PoisonForGap(model_id); },
              [metrics](const std::string& model_id) {
                metrics->RecordDuplicate(model_id);
              },
              [metrics](double seconds) { metrics->RecordSeqGapWait(seconds); },
              [metrics](const std::string& model_id, const DecodeStats& stats) {
                metrics->ObserveDecodeProgress(model_id, stats);
              }}),
      admission_(ObservedBy(options_.memory, metrics)) {
  metrics->SetMemoryLimits(options_.memory.limit_bytes,
                           options_.memory.per_tenant_bytes);
  AdmitExistingModels();
  if (!options_.checkpoint_root.empty()) {
    artifacts_.emplace(options_.checkpoint_root);
    sweep_ = std::make_unique<PeriodicSweep>(
        options_.artifact_sweep_interval, [this] {
          executor_->Submit(
              [this] { artifacts_->SweepExpired(options_.clock()); });
        });
  }
  if (options_.checkpointer != nullptr) {
    options_.checkpointer->set_server_state_source(
        [this](const std::string& model_id) {
          return SequencingState(model_id);
        });
  }
}

absl::Status TrainerService::RestoreSequencing(const std::string& model_id,
                                               absl::string_view server_state) {
  // Checkpoints written without a sequencing state leave it as it is.
  if (server_state.empty()) return absl::OkStatus();
  TALLY_ASSIGN_OR_RETURN(SequencerState state,
                         SequencerState::Parse(server_state));
  return scheduler_.sequencer().ImportState(model_id, std::move(state));
}

void TrainerService::ReportUnresumed(
    const std::vector<UnresumedModel>& failed) {
  for (const UnresumedModel& model : failed) {
    v1::UnresumedModel& entry = unresumed_[model.model_id];
    entry.set_model_id(ClientModelId(model.model_id));
    entry.set_checkpoint(std::filesystem::path(model.path).filename());
    entry.set_error(model.error.ToString());
  }
}

std::string TrainerService::SequencingState(const std::string& model_id) const {
  absl::StatusOr<SequencerState> state =
      scheduler_.sequencer().ExportState(model_id);
  if (!state.ok()) return "";
  // The sequencer records an executing request's outcome only after it
  // finished; a server restored from this checkpoint must not run it again.
  if (executing_seq_id_ > 0 && executing_model_id_ == model_id) {
    state->next_seq_id = std::max(state->next_seq_id, executing_seq_id_ + 1);
  }
  return state->Serialize();
}

void TrainerService::StopExecuting() {
  sweep_.reset();
  stopped_ = true;
  scheduler_.sequencer().Stop(StoppedBeforeRunning());
}

absl::Status TrainerService::Accepting() const {
  {
    absl::MutexLock lock(&failure_mu_);
    if (!rank_failure_.ok()) {
      return ReasonError(ErrorReason::kRankFailed,
                         absl::StrCat("a rank of this server failed and it is "
                                      "restarting (",
                                      rank_failure_.message(), ")"));
    }
  }
  if (stopped_) {
    return StoppedBeforeRunning();
  }
  return absl::OkStatus();
}

absl::Status TrainerService::Precheck(
    grpc::CallbackServerContext* context) const {
  TALLY_RETURN_IF_ERROR(Accepting());
  return CallerGaveUp(context);
}

absl::Status TrainerService::RunCommand(
    const std::function<absl::Status()>& command) {
  absl::Status status;
  {
    ProgressWatch::Scope running(options_.progress);
    status = command();
  }
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
  scheduler_.sequencer().Stop(Accepting());
  if (options_.on_rank_failure) options_.on_rank_failure(failure);
}

void TrainerService::PoisonForGap(const std::string& model_id) {
  // Queued before the waiting requests are answered, so an OptimStep sent
  // after their ABORTED runs after it.
  executor_->Submit(
      [this, model_id] { PoisonNow(model_id, kGapPoisonReason); });
}

void TrainerService::PoisonNow(const std::string& model_id,
                               const std::string& reason) {
  if (model_id.empty() || !Accepting().ok()) return;
  v1::internal::PoisonWindowCommand command;
  command.set_model_id(model_id);
  command.set_reason(reason);
  bool poisoned = false;
  const absl::Status status = RunCommand(
      [&] { return commands_.Run(kPoisonWindowCommand, command, &poisoned); });
  if (!status.ok()) {
    // The model was deleted meanwhile, or the server is failing.
    Log(LogLevel::kDebug,
        absl::StrCat("poisoning '", model_id, "': ", status.ToString()));
  }
}

namespace {

int64_t Tokens(const v1::ForwardBackwardRequest& request) {
  int64_t tokens = 0;
  for (const v1::Sample& sample : request.samples()) {
    tokens += sample.input_tokens_size();
  }
  return tokens;
}

}  // namespace

absl::Status TrainerService::ExplainUnresumed(
    const std::string& engine_id, const absl::Status& not_found) const {
  auto it = unresumed_.find(engine_id);
  if (!absl::IsNotFound(not_found) || it == unresumed_.end()) return not_found;
  return absl::NotFoundError(
      absl::StrCat(not_found.message(), ": --resume could not restore it from ",
                   it->second.checkpoint(), " (", it->second.error(),
                   "); CreateModel (and LoadCheckpoint) brings it back"));
}

absl::Status TrainerService::CheckCallFits(
    const v1::ForwardBackwardRequest& request) const {
  TALLY_ASSIGN_OR_RETURN(const ModelSummary model,
                         engine_->GetModel(request.model_id()));
  const int64_t experts =
      model.config.is_moe() ? model.config.num_local_experts : 0;
  const int64_t bound = ForwardBackwardResponseBound(request, experts);
  if (options_.max_message_bytes > 0 && bound > options_.max_message_bytes) {
    return ReasonError(
        ErrorReason::kMessageTooLarge,
        absl::StrCat(
            "the response could take ", bound, " bytes (",
            request.samples_size(), " samples, ", Tokens(request), " tokens",
            request.return_logprobs() ? ", return_logprobs" : "",
            "), more than --max-message-bytes (", options_.max_message_bytes,
            "); nothing was executed: send fewer tokens per call",
            request.return_logprobs() ? " or no return_logprobs" : "",
            ", or raise the limit"));
  }
  std::vector<int64_t> lengths;
  for (const v1::Sample& sample : request.samples()) {
    lengths.push_back(sample.input_tokens_size());
  }
  const TensorParallelRegion tp_region{
      TensorParallelInFloat32(engine_->mesh().shape().tp, model.dtype,
                              engine_->device()),
      model.lora};
  return admission_.CheckCall(CallActivationBytes(
      model.config, model.dtype, lengths, options_.max_batch_tokens,
      options_.attention, model.activation_checkpointing, tp_region));
}

absl::Status TrainerService::CheckTokensPerCall(
    int64_t tokens, absl::string_view counted) const {
  if (options_.max_tokens_per_call <= 0 ||
      tokens <= options_.max_tokens_per_call) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      counted, " ", tokens, " tokens, more than --max-tokens-per-call (",
      options_.max_tokens_per_call, "); split the call"));
}

absl::Status TrainerService::CheckTokensPerCall(
    const v1::ForwardBackwardRequest& request) const {
  return CheckTokensPerCall(Tokens(request), "samples hold");
}

absl::Status TrainerService::CheckTokensPerCall(
    const v1::SampleRequest& request) const {
  return CheckTokensPerCall(
      SampleTokenBound(request),
      "prompts x num_samples x (prompt + params.max_tokens) =");
}

absl::Status TrainerService::CheckTokensPerCall(
    const v1::ComputeLogprobsRequest& request) const {
  int64_t tokens = 0;
  for (const v1::TokenSequence& prompt : request.prompts()) {
    tokens += prompt.tokens_size();
  }
  return CheckTokensPerCall(tokens, "prompts hold");
}

namespace {

// The admission ledger's id of a LoRA base (model ids hold no spaces).
std::string BaseLedgerId(const std::string& base_key) {
  return absl::StrCat("lora base ", base_key);
}

// The admission ledger's id of a sampler snapshot of the model `engine_id`.
std::string SamplerLedgerId(const std::string& engine_id,
                            const std::string& name) {
  return absl::StrCat("sampler ", engine_id, " ", name);
}

// `spec`, parsed from a client's CreateModelRequest, for `server_form`, the
// request as the server rewrote it: the engine id and the confined paths,
// which ParseCreateModel copies as they are.
void UseServerForm(const v1::CreateModelRequest& server_form, ModelSpec& spec) {
  spec.model_id = server_form.model_id();
  spec.init_checkpoint = server_form.init_checkpoint();
  spec.lora.init_adapter = server_form.lora().init_adapter();
}

}  // namespace

void TrainerService::ChargeModel(const ModelSummary& model) {
  const int dp_shard = engine_->mesh().shape().dp_shard;
  const ZeroStage zero = engine_->zero_stage();
  const std::string tenant = TenantOf(model.model_id);
  if (!model.lora.enabled()) {
    admission_.Add(model.model_id, tenant,
                   ModelResidentBytes(model.config, model.dtype,
                                      model.optimizer, dp_shard, zero));
    return;
  }
  admission_.Add(model.model_id, tenant,
                 AdapterResidentBytes(model.config, model.lora, model.dtype,
                                      model.optimizer, dp_shard, zero));
  // The same entry for every adapter of the base: charged once.
  admission_.Add(BaseLedgerId(model.base), tenant,
                 BaseResidentBytes(model.config, model.dtype, dp_shard));
}

void TrainerService::AdmitExistingModels() {
  for (const ModelSummary& model : engine_->ListModels()) {
    scheduler_.sequencer().AddModel(model.model_id);
    ChargeModel(model);
  }
}

TrainerService::CreatedBytes TrainerService::CreatedModelBytes(
    const ModelSpec& spec) const {
  // An adapter is built on the base in memory under its key when there is
  // one, whatever the directory's config.json says by now.
  std::optional<LlamaConfig> config = engine_->BaseConfig(CurrentBaseKey(spec));
  const bool new_base = spec.lora.enabled() && !config.has_value();
  if (!config.has_value()) config = spec.config;
  if (config->vocab_size == 0 && !spec.init_checkpoint.empty()) {
    absl::StatusOr<LlamaConfig> read =
        ReadHfConfig(spec.init_checkpoint + "/config.json");
    if (!read.ok()) return {};
    config = *read;
  }
  config = config->WithDefaults();
  const int dp_shard = engine_->mesh().shape().dp_shard;
  const ZeroStage zero = engine_->zero_stage();
  CreatedBytes bytes;
  if (!spec.lora.enabled()) {
    bytes.model =
        ModelResidentBytes(*config, spec.dtype, spec.optimizer, dp_shard, zero);
    return bytes;
  }
  bytes.model = AdapterResidentBytes(*config, spec.lora, spec.dtype,
                                     spec.optimizer, dp_shard, zero);
  if (new_base) {
    bytes.new_base = BaseResidentBytes(*config, spec.dtype, dp_shard);
  }
  return bytes;
}

std::string TrainerService::TenantOf(const std::string& engine_id) const {
  if (options_.authenticator == nullptr) return "";
  return engine_id.substr(0, engine_id.find('/'));
}

void TrainerService::FillNextSeqId(const std::string& engine_id,
                                   v1::ModelInfo* info) const {
  info->set_next_seq_id(
      scheduler_.sequencer().NextSeqId(engine_id).value_or(1));
}

absl::StatusOr<std::string> TrainerService::Authenticate(
    const grpc::CallbackServerContext& context) {
  if (options_.authenticator == nullptr) return std::string();
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) return options_.authenticator->Authenticate({});
  return options_.authenticator->Authenticate(
      absl::string_view(it->second.data(), it->second.size()));
}

absl::StatusOr<std::string> TrainerService::AuthenticateCall(
    const grpc::CallbackServerContext& context) {
  absl::StatusOr<std::string> tenant = Authenticate(context);
  if (!tenant.ok()) {
    metrics_->RecordAuthFailure(context.client_metadata().count("authorization")
                                    ? "invalid_token"
                                    : "missing_token");
  }
  return tenant;
}

absl::Status TrainerService::ConfinePath(
    const grpc::CallbackServerContext& context, std::string* path) {
  if (absl::StartsWith(*path, kHandleScheme)) {
    // A handle names its path under the tenant's root.
    TALLY_RETURN_IF_ERROR(ArtifactsAvailable());
    path->erase(0, sizeof(kHandleScheme) - 1);
  }
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

absl::Status TrainerService::ValidateModelAndPath(
    const grpc::CallbackServerContext& context, const std::string& model_id,
    const absl::Status& fields, std::string* path) {
  TALLY_RETURN_IF_ERROR(ValidateModelId(model_id));
  TALLY_RETURN_IF_ERROR(fields);
  return ConfinePath(context, path);
}

void TrainerService::Finish(const char* method,
                            grpc::ServerUnaryReactor* reactor,
                            const absl::Status& status) {
  metrics_->RecordRequest(method, absl::StatusCodeToString(status.code()));
  reactor->Finish(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* TrainerService::Execute(
    const Call& call, absl::Status validation,
    std::function<absl::Status()> command) {
  grpc::CallbackServerContext* context = call.context;
  auto* reactor = new CancellableReactor;
  const absl::StatusOr<std::string> tenant = AuthenticateCall(*context);
  if (!tenant.ok()) {
    Finish(call.method, reactor, tenant.status());
    return reactor;
  }
  if (validation.ok() && call.model_id != nullptr) {
    // Validated in the client's form; from here on the engine id, which the
    // budget, the sequencer and the engine are keyed by.
    *call.model_id = ScopedModelId(*tenant, *call.model_id);
  }
  const std::string model_id =
      call.model_id == nullptr ? std::string() : *call.model_id;
  if (validation.ok()) validation = Accepting();
  if (!validation.ok()) {
    Finish(call.method, reactor, validation);
    return reactor;
  }
  // From here the request waits (queue, seq_id order) until it runs.
  command = [this, command = std::move(command), method = call.method,
             accepted = absl::Now()] {
    metrics_->ObserveQueueWait(method,
                               absl::ToDoubleSeconds(absl::Now() - accepted));
    return command();
  };
  ScheduledRequest scheduled;
  scheduled.tenant = *tenant;
  scheduled.model_id = model_id;
  scheduled.seq_id = call.seq_id;
  scheduled.closes_window = call.closes_window;
  scheduled.precheck = [this, context] { return Precheck(context); };
  scheduled.stop_check = [context] {
    return CallerGaveUpWhileRunning(*context);
  };
  scheduled.reply = [this, method = call.method,
                     reactor](const absl::Status& status) {
    Finish(method, reactor, status);
  };
  if (call.seq_id == 0) {
    scheduled.run = [this, command] { return RunCommand(command); };
    scheduler_.Schedule(std::move(scheduled));
    return reactor;
  }
  google::protobuf::Message* response = call.response;
  scheduled.fingerprint = RequestFingerprint(*call.request);
  scheduled.run = [this, command, model_id, seq_id = call.seq_id] {
    executing_model_id_ = model_id;
    executing_seq_id_ = seq_id;
    absl::Cleanup done = [this] {
      executing_seq_id_ = 0;
      executing_model_id_.clear();
    };
    return RunCommand(command);
  };
  scheduled.save_response = [response] {
    return SerializeDeterministically(*response);
  };
  scheduled.load_response = [response](const std::string& bytes) {
    return response->ParseFromString(bytes);
  };
  const RequestTicket ticket = scheduler_.Schedule(std::move(scheduled));
  // A caller that gives up while its request waits for its seq_id's turn
  // is answered now and gives its budget slot back.
  reactor->OnCancelled([this, context, ticket] {
    absl::Status why = CallerGaveUp(context);
    if (why.ok()) why = absl::CancelledError("the call was cancelled");
    scheduler_.Withdraw(ticket, why);
  });
  return reactor;
}

grpc::ServerUnaryReactor* TrainerService::CreateModel(
    grpc::CallbackServerContext* context, const v1::CreateModelRequest* request,
    v1::ModelInfo* response) {
  auto server_form = std::make_shared<v1::CreateModelRequest>(*request);
  // Parsed once, here; the command runs on this spec.
  auto spec = std::make_shared<absl::StatusOr<ModelSpec>>(
      kCreateModelCommand.parse(*request));
  absl::Status validation = FirstError(
      request->model_id().empty() ? absl::OkStatus()
                                  : ValidateModelId(request->model_id()),
      spec->status());
  if (validation.ok() && !request->init_checkpoint().empty()) {
    validation =
        ResolveInitCheckpoint(*context, server_form->mutable_init_checkpoint());
  }
  if (validation.ok()) {
    validation = ResumeAdapterState(*context, *server_form, *spec);
  }
  if (validation.ok() && !request->lora().init_adapter().empty()) {
    validation = ConfinePath(
        *context, server_form->mutable_lora()->mutable_init_adapter());
  }
  return Execute(
      {"CreateModel", context, server_form->mutable_model_id()}, validation,
      [this, server_form, spec, response]() -> absl::Status {
        const v1::CreateModelRequest& request = *server_form;
        UseServerForm(request, **spec);
        // Before anything is allocated, on any rank.
        const CreatedBytes bytes = CreatedModelBytes(**spec);
        const std::string tenant = TenantOf(request.model_id());
        TALLY_RETURN_IF_ERROR(
            admission_.CheckModel(tenant, bytes.model + bytes.new_base));
        TALLY_RETURN_IF_ERROR(
            commands_.Run(kCreateModelCommand, request, **spec, response));
        const std::string engine_id = CreatedModelId(request, *response);
        // Charged as built (its config, its base), which the estimate
        // predicted unless the directory was published over in between.
        const absl::StatusOr<ModelSummary> built = engine_->GetModel(engine_id);
        if (built.ok()) ChargeModel(*built);
        unresumed_.erase(engine_id);
        scheduler_.sequencer().AddModel(engine_id);
        FillNextSeqId(engine_id, response);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::GetModel(
    grpc::CallbackServerContext* context, const v1::GetModelRequest* request,
    v1::ModelInfo* response) {
  auto server_form = std::make_shared<v1::GetModelRequest>(*request);
  return Execute({"GetModel", context, server_form->mutable_model_id()},
                 ValidateModelId(request->model_id()),
                 [this, server_form, response]() -> absl::Status {
                   const std::string& engine_id = server_form->model_id();
                   absl::StatusOr<ModelSummary> summary =
                       engine_->GetModel(engine_id);
                   if (!summary.ok())
                     return ExplainUnresumed(engine_id, summary.status());
                   ToProto(*summary, response);
                   FillNextSeqId(engine_id, response);
                   return absl::OkStatus();
                 });
}

grpc::ServerUnaryReactor* TrainerService::GetServerInfo(
    grpc::CallbackServerContext* context,
    const v1::GetServerInfoRequest* /*request*/, v1::ServerInfo* response) {
  // Static facts: answered on the gRPC thread, after authentication.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::StatusOr<std::string> tenant = AuthenticateCall(*context);
  if (tenant.ok()) {
    FillServerInfo(engine_->mesh(), engine_->zero_stage(), ServerInfoLimits(),
                   options_.devices, options_.authenticator != nullptr,
                   response);
    if (!options_.models_root.empty()) {
      for (std::string& name : ListModelNames(options_.models_root)) {
        response->add_base_models(std::move(name));
      }
    }
  }
  Finish("GetServerInfo", reactor, tenant.status());
  return reactor;
}

v1::ServerInfo::Limits TrainerService::ServerInfoLimits() const {
  v1::ServerInfo::Limits limits;
  limits.set_max_message_bytes(options_.max_message_bytes);
  limits.set_max_tokens_per_call(options_.max_tokens_per_call);
  limits.set_max_batch_tokens(options_.max_batch_tokens);
  limits.set_max_memory_bytes(
      static_cast<int64_t>(options_.memory.limit_bytes));
  limits.set_max_memory_bytes_per_tenant(
      static_cast<int64_t>(options_.memory.per_tenant_bytes));
  limits.set_max_queued_requests(options_.budget.total);
  limits.set_max_queued_requests_per_model(options_.budget.per_model);
  limits.set_max_queued_requests_per_tenant(options_.budget.per_tenant);
  return limits;
}

grpc::ServerUnaryReactor* TrainerService::ListModels(
    grpc::CallbackServerContext* context, const v1::ListModelsRequest* request,
    v1::ListModelsResponse* response) {
  // A tenant lists its own models only (Execute refuses bad credentials).
  const std::string tenant = Authenticate(*context).value_or("");
  absl::StatusOr<ModelPage> page = ParseListModels(*request);
  return Execute(
      {"ListModels", context}, page.status(),
      [this, response, tenant, page]() -> absl::Status {
        // The engine lists models in engine id order.
        std::string last;
        for (const ModelSummary& s : engine_->ListModels()) {
          if (!InTenant(s.model_id, tenant) || s.model_id <= page->after) {
            continue;
          }
          if (response->models_size() == page->size) {
            response->set_next_page_token(ModelPageToken(last));
            break;
          }
          v1::ModelInfo* info = response->add_models();
          ToProto(s, info);
          FillNextSeqId(s.model_id, info);
          last = s.model_id;
        }
        if (!page->after.empty()) return absl::OkStatus();
        for (const auto& [engine_id, entry] : unresumed_) {
          if (InTenant(engine_id, tenant)) *response->add_unresumed() = entry;
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::DeleteModel(
    grpc::CallbackServerContext* context, const v1::DeleteModelRequest* request,
    v1::DeleteModelResponse* response) {
  auto server_form = std::make_shared<v1::DeleteModelRequest>(*request);
  return Execute(
      {"DeleteModel", context, server_form->mutable_model_id()},
      ValidateModelId(request->model_id()),
      [this, server_form, response]() -> absl::Status {
        const std::string& engine_id = server_form->model_id();
        // Its sampler snapshots go with it.
        const std::vector<SamplerSummary> samplers =
            engine_->ListSamplers(engine_id).value_or(
                std::vector<SamplerSummary>());
        TALLY_RETURN_IF_ERROR(
            commands_.Run(kDeleteModelCommand, *server_form, response));
        FillNextSeqId(engine_id, response->mutable_model());
        scheduler_.sequencer().RemoveModel(engine_id);
        admission_.Remove(engine_id);
        for (const SamplerSummary& sampler : samplers) {
          admission_.Remove(SamplerLedgerId(engine_id, sampler.name));
        }
        const std::string& base = response->model().base();
        if (!base.empty() && !engine_->HasBase(base)) {
          admission_.Remove(BaseLedgerId(base));
        }
        if (options_.checkpointer != nullptr) {
          options_.checkpointer->ForgetModel(engine_id);
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::ForwardBackward(
    grpc::CallbackServerContext* context,
    const v1::ForwardBackwardRequest* request,
    v1::ForwardBackwardResponse* response) {
  auto server_form = std::make_shared<v1::ForwardBackwardRequest>(*request);
  // Parsed once, here; the command runs on these arguments.
  auto args = std::make_shared<absl::StatusOr<ForwardBackwardArgs>>(
      kForwardBackwardCommand.parse(*request));
  return Execute({"ForwardBackward", context, server_form->mutable_model_id(),
                  request->seq_id(), server_form.get(), response},
                 FirstError(FirstError(ValidateModelId(request->model_id()),
                                       args->status()),
                            CheckTokensPerCall(*request)),
                 [this, server_form, args, response]() -> absl::Status {
                   TALLY_RETURN_IF_ERROR(CheckCallFits(*server_form));
                   return commands_.Run(kForwardBackwardCommand, *server_form,
                                        **args, response);
                 });
}

grpc::ServerUnaryReactor* TrainerService::OptimStep(
    grpc::CallbackServerContext* context, const v1::OptimStepRequest* request,
    v1::OptimStepResponse* response) {
  auto server_form = std::make_shared<v1::OptimStepRequest>(*request);
  auto args = std::make_shared<absl::StatusOr<OptimStepArgs>>(
      kOptimStepCommand.parse(*request));
  return Execute(
      {"OptimStep", context, server_form->mutable_model_id(), request->seq_id(),
       server_form.get(), response,
       /*closes_window=*/true},
      FirstError(ValidateModelId(request->model_id()), args->status()),
      [this, server_form, args, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(
            commands_.Run(kOptimStepCommand, *server_form, **args, response));
        if (options_.checkpointer != nullptr) {
          options_.checkpointer->AfterOptimStep(server_form->model_id(),
                                                *response);
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::AbortAccumulation(
    grpc::CallbackServerContext* context,
    const v1::AbortAccumulationRequest* request,
    v1::AbortAccumulationResponse* response) {
  auto server_form = std::make_shared<v1::AbortAccumulationRequest>(*request);
  return Execute(
      {"AbortAccumulation", context, server_form->mutable_model_id(),
       request->seq_id(), server_form.get(), response,
       /*closes_window=*/true},
      ValidateModelId(request->model_id()), [this, server_form, response] {
        return commands_.Run(kAbortAccumulationCommand, *server_form, response);
      });
}

grpc::ServerUnaryReactor* TrainerService::SaveCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::SaveCheckpointRequest* request,
    v1::SaveCheckpointResponse* response) {
  auto server_form = std::make_shared<v1::SaveCheckpointRequest>(*request);
  const absl::Status validation = ValidateModelAndPath(
      *context, request->model_id(),
      FirstError(
          ValidateCheckpointPath(request->path()),
          request->ttl_seconds() > 0 ? ArtifactsAvailable() : absl::OkStatus()),
      server_form->mutable_path());
  return Execute(
      {"SaveCheckpoint", context, server_form->mutable_model_id(),
       request->seq_id(), server_form.get(), response},
      validation, [this, server_form, response] {
        RankZeroData rank_zero;
        rank_zero.server_state = SequencingState(server_form->model_id());
        TALLY_RETURN_IF_ERROR(commands_.Run(kSaveCheckpointCommand,
                                            *server_form, response, rank_zero));
        TALLY_ASSIGN_OR_RETURN(
            *response->mutable_handle(),
            RecordArtifact(server_form->model_id(), response->path(),
                           response->step(), server_form->ttl_seconds()));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::LoadCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::LoadCheckpointRequest* request,
    v1::LoadCheckpointResponse* response) {
  auto server_form = std::make_shared<v1::LoadCheckpointRequest>(*request);
  const absl::Status validation = ValidateModelAndPath(
      *context, request->model_id(), ValidateCheckpointPath(request->path()),
      server_form->mutable_path());
  return Execute(
      {"LoadCheckpoint", context, server_form->mutable_model_id(),
       request->seq_id(), server_form.get(), response,
       /*closes_window=*/true},
      validation, [this, server_form, response]() -> absl::Status {
        const v1::LoadCheckpointRequest& request = *server_form;
        LoadResult loaded;
        RankZeroData rank_zero;
        rank_zero.loaded = &loaded;
        TALLY_RETURN_IF_ERROR(commands_.Run(kLoadCheckpointCommand, request,
                                            response, rank_zero));
        if (request.seq_id() > 0) {
          // A sequenced load is itself the model's current seq_id: the
          // client's sequence goes on after it, so the checkpoint's
          // sequencing state is not imported.
          response->mutable_model()->set_next_seq_id(request.seq_id() + 1);
        } else {
          absl::Status restored =
              RestoreSequencing(request.model_id(), loaded.server_state);
          if (restored.ok() && !loaded.server_state.empty()) {
            TALLY_RETURN_IF_ERROR(
                PoisonDroppedWindow(engine_->control(), *engine_,
                                    request.model_id(), loaded.unsaved_window,
                                    "LoadCheckpoint restored the seq_ids of"));
          }
          if (!restored.ok()) {
            // The weights are loaded; the live sequence stays.
            Log(LogLevel::kWarning,
                absl::StrCat(
                    "LoadCheckpoint of '", request.model_id(),
                    "' kept the current seq_ids: ", restored.ToString()));
          }
          FillNextSeqId(request.model_id(), response->mutable_model());
        }
        if (options_.checkpointer != nullptr) {
          options_.checkpointer->AfterLoad(request.model_id(),
                                           response->model().step());
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::ExportWeights(
    grpc::CallbackServerContext* context,
    const v1::ExportWeightsRequest* request,
    v1::ExportWeightsResponse* response) {
  auto server_form = std::make_shared<v1::ExportWeightsRequest>(*request);
  auto options = std::make_shared<absl::StatusOr<ExportOptions>>(
      kExportWeightsCommand.parse(*request));
  const absl::Status validation = ValidateModelAndPath(
      *context, request->model_id(),
      FirstError(options->status(), request->ttl_seconds() > 0
                                        ? ArtifactsAvailable()
                                        : absl::OkStatus()),
      server_form->mutable_path());
  return Execute(
      {"ExportWeights", context, server_form->mutable_model_id(),
       request->seq_id(), server_form.get(), response},
      validation, [this, server_form, options, response]() -> absl::Status {
        TALLY_RETURN_IF_ERROR(commands_.Run(kExportWeightsCommand, *server_form,
                                            **options, response));
        const absl::StatusOr<ModelSummary> model =
            engine_->GetModel(server_form->model_id());
        TALLY_ASSIGN_OR_RETURN(
            *response->mutable_handle(),
            RecordArtifact(server_form->model_id(), response->path(),
                           model.ok() ? model->step : 0,
                           server_form->ttl_seconds()));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::Sample(
    grpc::CallbackServerContext* context, const v1::SampleRequest* request,
    v1::SampleResponse* response) {
  auto server_form = std::make_shared<v1::SampleRequest>(*request);
  auto args = std::make_shared<absl::StatusOr<SampleArgs>>(
      kSampleCommand.parse(*request));
  return Execute(
      {"Sample", context, server_form->mutable_model_id(), request->seq_id(),
       server_form.get(), response},
      FirstError(
          FirstError(ValidateModelId(request->model_id()), args->status()),
          FirstError(
              CheckTokensPerCall(*request),
              CheckSampleResponseFits(*request, options_.max_message_bytes))),
      [this, server_form, args, response] {
        // Drawn here, on rank 0, after the request was fingerprinted: the
        // seed travels with the replicated request, so that every rank
        // draws the same tokens.
        if (!server_form->params().has_seed()) {
          server_form->mutable_params()->set_seed(DrawSeed());
          (*args)->seed = server_form->params().seed();
        }
        return commands_.Run(kSampleCommand, *server_form, **args, response);
      });
}

grpc::ServerUnaryReactor* TrainerService::ComputeLogprobs(
    grpc::CallbackServerContext* context,
    const v1::ComputeLogprobsRequest* request,
    v1::ComputeLogprobsResponse* response) {
  auto server_form = std::make_shared<v1::ComputeLogprobsRequest>(*request);
  auto args = std::make_shared<absl::StatusOr<LogprobsArgs>>(
      kComputeLogprobsCommand.parse(*request));
  return Execute(
      {"ComputeLogprobs", context, server_form->mutable_model_id(),
       request->seq_id(), server_form.get(), response},
      FirstError(
          FirstError(ValidateModelId(request->model_id()), args->status()),
          FirstError(CheckTokensPerCall(*request),
                     CheckComputeLogprobsResponseFits(
                         *request, options_.max_message_bytes))),
      [this, server_form, args, response] {
        return commands_.Run(kComputeLogprobsCommand, *server_form, **args,
                             response);
      });
}

// Artifacts through the API (server/artifacts.h).

absl::Status TrainerService::ArtifactsAvailable() const {
  if (artifacts_.has_value()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "this server keeps no artifacts: start it with --checkpoint-root for "
      "tally:// handles, ttl_seconds and the artifact RPCs");
}

absl::StatusOr<std::string> TrainerService::RecordArtifact(
    const std::string& engine_id, const std::string& dir, int64_t step,
    uint64_t ttl_seconds) {
  if (!artifacts_.has_value()) return std::string();
  const std::string tenant = TenantOf(engine_id);
  ArtifactRecord record;
  record.model_id = ClientModelId(engine_id);
  record.step = step;
  record.created = options_.clock();
  record.expires = ExpiryOf(record.created, ttl_seconds);
  TALLY_RETURN_IF_ERROR(artifacts_->Record(dir, record));
  return artifacts_->HandleOf(tenant, dir);
}

absl::Status TrainerService::ResolveInitCheckpoint(
    const grpc::CallbackServerContext& context, std::string* init_checkpoint) {
  if (!options_.models_root.empty()) {
    TALLY_ASSIGN_OR_RETURN(
        const std::optional<std::string> dir,
        ResolveModelName(options_.models_root, *init_checkpoint));
    if (dir.has_value()) {
      *init_checkpoint = *dir;
      return absl::OkStatus();
    }
  }
  return ConfinePath(context, init_checkpoint);
}

absl::Status TrainerService::ResumeAdapterState(
    const grpc::CallbackServerContext& context, v1::CreateModelRequest& request,
    absl::StatusOr<ModelSpec>& spec) {
  TALLY_ASSIGN_OR_RETURN(
      const bool expanded,
      ExpandAdapterState(request, options_.models_root,
                         [this, &context](std::string* path) {
                           return ConfinePath(context, path);
                         }));
  if (expanded) spec = kCreateModelCommand.parse(request);
  return spec.status();
}

grpc::ServerUnaryReactor* TrainerService::ListCheckpoints(
    grpc::CallbackServerContext* context,
    const v1::ListCheckpointsRequest* request,
    v1::ListCheckpointsResponse* response) {
  const std::string tenant = Authenticate(*context).value_or("");
  const std::string model_id = request->model_id();
  return Execute({"ListCheckpoints", context},
                 FirstError(ArtifactsAvailable(),
                            model_id.empty() ? absl::OkStatus()
                                             : ValidateModelId(model_id)),
                 [this, tenant, model_id, response]() -> absl::Status {
                   TALLY_ASSIGN_OR_RETURN(std::vector<v1::Artifact> listed,
                                          artifacts_->List(tenant, model_id));
                   for (v1::Artifact& artifact : listed) {
                     *response->add_artifacts() = std::move(artifact);
                   }
                   return absl::OkStatus();
                 });
}

grpc::ServerUnaryReactor* TrainerService::DeleteCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::DeleteCheckpointRequest* request,
    v1::DeleteCheckpointResponse* response) {
  const std::string tenant = Authenticate(*context).value_or("");
  const std::string handle = request->handle();
  return Execute({"DeleteCheckpoint", context}, ArtifactsAvailable(),
                 [this, tenant, handle, response]() -> absl::Status {
                   TALLY_ASSIGN_OR_RETURN(*response->mutable_deleted(),
                                          artifacts_->Delete(tenant, handle));
                   return absl::OkStatus();
                 });
}

grpc::ServerWriteReactor<v1::DownloadArtifactChunk>*
TrainerService::DownloadArtifact(grpc::CallbackServerContext* context,
                                 const v1::DownloadArtifactRequest* request) {
  auto finished = [this](const absl::Status& status) {
    metrics_->RecordRequest("DownloadArtifact",
                            absl::StatusCodeToString(status.code()));
  };
  const absl::StatusOr<std::string> tenant = AuthenticateCall(*context);
  if (!tenant.ok()) return ArtifactDownload::Refuse(tenant.status(), finished);
  if (absl::Status available = ArtifactsAvailable(); !available.ok()) {
    return ArtifactDownload::Refuse(available, finished);
  }
  absl::StatusOr<std::string> dir =
      artifacts_->Resolve(*tenant, request->handle());
  absl::StatusOr<std::vector<v1::ArtifactFile>> manifest =
      dir.ok() ? artifacts_->Manifest(*dir) : dir.status();
  if (!manifest.ok()) {
    return ArtifactDownload::Refuse(manifest.status(), finished);
  }
  v1::DownloadArtifactChunk first;
  for (const v1::ArtifactFile& file : *manifest) *first.add_manifest() = file;
  // A chunk and its few fields stay under --max-message-bytes.
  constexpr int64_t kFieldsBytes = 4096;
  const uint64_t chunk_bytes =
      options_.max_message_bytes > 0
          ? static_cast<uint64_t>(std::clamp<int64_t>(
                options_.max_message_bytes - kFieldsBytes, kFieldsBytes,
                static_cast<int64_t>(ArtifactReader::kDefaultChunkBytes)))
          : ArtifactReader::kDefaultChunkBytes;
  ArtifactReader reader(*dir, std::move(*manifest), request->offset(),
                        chunk_bytes);
  const absl::StatusOr<uint64_t> total = reader.Validate();
  if (!total.ok()) return ArtifactDownload::Refuse(total.status(), finished);
  first.set_total_bytes(*total);
  first.set_offset(request->offset());
  auto* download = new ArtifactDownload(std::move(first), std::move(reader),
                                        request->manifest_only(), finished);
  download->Start();
  return download;
}

absl::StatusOr<double> TrainerService::AdmitSnapshot(
    const v1::SaveWeightsForSamplerRequest& request) const {
  const std::string& engine_id = request.model_id();
  TALLY_ASSIGN_OR_RETURN(const ModelSummary model,
                         engine_->GetModel(engine_id));
  TALLY_ASSIGN_OR_RETURN(const std::vector<SamplerSummary> samplers,
                         engine_->ListSamplers(engine_id));
  for (const SamplerSummary& sampler : samplers) {
    if (sampler.name == request.name()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "sampler '", request.name(), "' of model '", ClientModelId(engine_id),
          "' already exists; DeleteSampler it or choose another name"));
    }
  }
  const double bytes = SamplerSnapshotBytes(
      model, engine_->mesh().shape().dp_shard, engine_->zero_stage());
  TALLY_RETURN_IF_ERROR(admission_.CheckSnapshot(TenantOf(engine_id), bytes));
  return bytes;
}

grpc::ServerUnaryReactor* TrainerService::SaveWeightsForSampler(
    grpc::CallbackServerContext* context,
    const v1::SaveWeightsForSamplerRequest* request,
    v1::SamplerInfo* response) {
  auto server_form =
      std::make_shared<v1::SaveWeightsForSamplerRequest>(*request);
  return Execute(
      {"SaveWeightsForSampler", context, server_form->mutable_model_id(),
       request->seq_id(), server_form.get(), response},
      FirstError(ValidateModelId(request->model_id()),
                 ValidateSamplerRequest(*request)),
      [this, server_form, response]() -> absl::Status {
        const v1::SaveWeightsForSamplerRequest& request = *server_form;
        // Before any rank copies anything.
        TALLY_ASSIGN_OR_RETURN(const double bytes, AdmitSnapshot(request));
        TALLY_RETURN_IF_ERROR(commands_.Run(kSaveWeightsForSamplerCommand,
                                            request, NoArgs(), response));
        admission_.Add(SamplerLedgerId(request.model_id(), request.name()),
                       TenantOf(request.model_id()), bytes);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::ListSamplers(
    grpc::CallbackServerContext* context,
    const v1::ListSamplersRequest* request,
    v1::ListSamplersResponse* response) {
  // A tenant lists its own models' snapshots only (Execute refuses bad
  // credentials).
  const std::string tenant = Authenticate(*context).value_or("");
  auto server_form = std::make_shared<v1::ListSamplersRequest>(*request);
  const bool one_model = !request->model_id().empty();
  return Execute(
      {"ListSamplers", context,
       one_model ? server_form->mutable_model_id() : nullptr},
      one_model ? ValidateModelId(request->model_id()) : absl::OkStatus(),
      [this, server_form, response, tenant]() -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(const std::vector<SamplerSummary> samplers,
                               engine_->ListSamplers(server_form->model_id()));
        for (const SamplerSummary& sampler : samplers) {
          if (InTenant(sampler.model_id, tenant)) {
            ToProto(sampler, response->add_samplers());
          }
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TrainerService::DeleteSampler(
    grpc::CallbackServerContext* context,
    const v1::DeleteSamplerRequest* request, v1::SamplerInfo* response) {
  auto server_form = std::make_shared<v1::DeleteSamplerRequest>(*request);
  return Execute({"DeleteSampler", context, server_form->mutable_model_id()},
                 FirstError(ValidateModelId(request->model_id()),
                            ValidateSamplerRequest(*request)),
                 [this, server_form, response]() -> absl::Status {
                   TALLY_RETURN_IF_ERROR(commands_.Run(kDeleteSamplerCommand,
                                                       *server_form, response));
                   admission_.Remove(SamplerLedgerId(server_form->model_id(),
                                                     server_form->name()));
                   return absl::OkStatus();
                 });
}

}  // namespace tally
