// TrainerService: the gRPC front end of tally.v1.Trainer (callback API).
//
// A handler authenticates the caller (bearer token, when configured),
// validates its request's proto-level fields on the gRPC thread, copies the
// request into the server's form (the model id scoped to the caller's tenant,
// "<tenant>/<id>", the engine id; a checkpoint path confined) and hands the
// command to the RequestScheduler: a slot of the request budget
// (RESOURCE_EXHAUSTED when full), the CommandExecutor — directly when
// unsequenced (seq_id 0), through the Sequencer (exactly once, in seq_id
// order) when sequenced —, and exactly one reply. The executor runs the
// command's entry of the command table on every rank (commands.h) and
// finishes the RPC. A request whose client cancelled it or whose deadline
// passed before it ran is not executed; a sequenced one is answered as soon as
// gRPC reports it (CancellableReactor), giving its budget slot back. A
// command that throws is answered INTERNAL with its model's window poisoned.
//
// Checkpoints carry each model's sequencing state (next seq_id, cached
// outcomes) in their server_state, so a resumed server continues the seq_ids.
//
// A failed collective (a dead or hung rank) makes the service answer every
// queued and new request UNAVAILABLE and calls `on_rank_failure`; the server
// then exits non-zero for its supervisor to restart it.
//
//   tally::TrainerServiceOptions options;
//   options.on_rank_failure = [&](const absl::Status& failure) { ... };
//   tally::TrainerService service(engine.get(), &executor, metrics.get(),
//                                 options);
//   grpc::ServerBuilder builder;
//   builder.RegisterService(&service);
//   ...
//   service.StopExecuting();  // at shutdown, before grpc::Server::Shutdown
#ifndef TALLY_SERVER_TRAINER_SERVICE_H_
#define TALLY_SERVER_TRAINER_SERVICE_H_

#include <google/protobuf/message.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "runtime/engine/engine.h"
#include "server/admission.h"
#include "server/artifacts.h"
#include "server/auth.h"
#include "server/checkpoint_retention.h"
#include "server/checkpointer.h"
#include "server/commands.h"
#include "server/executor.h"
#include "server/metrics.h"
#include "server/progress_watch.h"
#include "server/request_scheduler.h"
#include "server/sequencer.h"
#include "tally/v1/trainer.grpc.pb.h"

namespace tally {

// Settings of the service. The access control and checkpoint ones default
// to off.
struct TrainerServiceOptions {
  SequencerOptions sequencing;
  RequestBudgetLimits budget;
  // Called once, on the executor thread, when a collective failed.
  std::function<void(const absl::Status& failure)> on_rank_failure;
  // Bearer tokens → tenants; a tenant's model ids are scoped to it (see
  // ScopedModelId in convert.h). Null: no authentication.
  const Authenticator* authenticator = nullptr;
  // Confines client checkpoint paths (ConfineToRoot), to <root>/<tenant>
  // with authentication. Empty: paths are used as given.
  std::string checkpoint_root;
  // Periodic checkpoints after OptimStep. Null: none.
  Checkpointer* checkpointer = nullptr;
  // Marks each command running (for /readyz). Null: none.
  ProgressWatch* progress = nullptr;
  // The largest message gRPC sends (--max-message-bytes): a request whose
  // response could exceed it is refused before it runs. 0: no bound.
  int64_t max_message_bytes = 0;
  // Memory admission (--max-memory-bytes, --max-memory-bytes-per-tenant).
  MemoryAdmissionOptions memory;
  // The engine's micro-batch size, which bounds a call's activations.
  int64_t max_batch_tokens = EngineOptions().max_batch_tokens;
  AttentionOptions attention;  // the engine's: its activation bound
  // Tokens of one ForwardBackward (all samples); 0: no cap.
  int64_t max_tokens_per_call = 0;
  // GetServerInfo's devices (DescribeDevices), fixed at start.
  v1::ServerInfo::Devices devices;
  // Artifacts (ListCheckpoints, DeleteCheckpoint, DownloadArtifact,
  // ttl_seconds; need checkpoint_root): the clock their records use, and
  // how often the executor deletes the expired ones.
  std::function<absl::Time()> clock = [] { return absl::Now(); };
  absl::Duration artifact_sweep_interval = absl::Minutes(1);
  // --models-root: CreateModel.init_checkpoint names such as "Org/Name"
  // resolve there (models_root.h). Empty: none.
  std::string models_root;
};

class TrainerService final : public v1::Trainer::CallbackService {
 public:
  // Mutating commands are replicated over engine->control() (ranks > 0 run
  // CommandLoop); the engine's existing models are registered for
  // sequencing, and options.checkpointer saves their sequencing state.
  TrainerService(Engine* engine, CommandExecutor* executor,
                 ServerMetrics* metrics, TrainerServiceOptions options);

  // Restores `model_id`'s sequencing state from a checkpoint's server_state
  // (Checkpointer::Resume), before serving; empty bytes change nothing.
  // DATA_LOSS for damaged bytes.
  absl::Status RestoreSequencing(const std::string& model_id,
                                 absl::string_view server_state);

  // Models --resume could not restore, before serving: ListModels reports
  // them and GetModel's NOT_FOUND says why, until the id is created again.
  void ReportUnresumed(const std::vector<UnresumedModel>& failed);

  // From now on requests that have not started executing are answered
  // UNAVAILABLE (not executed: a retry on the restarted server runs them);
  // executing ones finish.
  void StopExecuting();

  grpc::ServerUnaryReactor* CreateModel(grpc::CallbackServerContext* context,
                                        const v1::CreateModelRequest* request,
                                        v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(
      grpc::CallbackServerContext* context,
      const v1::GetServerInfoRequest* request,
      v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const v1::ListModelsRequest* request,
      v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteModel(
      grpc::CallbackServerContext* context,
      const v1::DeleteModelRequest* request,
      v1::DeleteModelResponse* response) override;
  grpc::ServerUnaryReactor* ForwardBackward(
      grpc::CallbackServerContext* context,
      const v1::ForwardBackwardRequest* request,
      v1::ForwardBackwardResponse* response) override;
  grpc::ServerUnaryReactor* OptimStep(grpc::CallbackServerContext* context,
                                      const v1::OptimStepRequest* request,
                                      v1::OptimStepResponse* response) override;
  grpc::ServerUnaryReactor* AbortAccumulation(
      grpc::CallbackServerContext* context,
      const v1::AbortAccumulationRequest* request,
      v1::AbortAccumulationResponse* response) override;
  grpc::ServerUnaryReactor* SaveCheckpoint(
      grpc::CallbackServerContext* context,
      const v1::SaveCheckpointRequest* request,
      v1::SaveCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(
      grpc::CallbackServerContext* context,
      const v1::LoadCheckpointRequest* request,
      v1::LoadCheckpointResponse* response) override;
  // Ordered and exactly-once like SaveCheckpoint; does not close the window.
  grpc::ServerUnaryReactor* ExportWeights(
      grpc::CallbackServerContext* context,
      const v1::ExportWeightsRequest* request,
      v1::ExportWeightsResponse* response) override;
  // Ordered like ExportWeights (seq_id > 0), read-only: the window stays.
  grpc::ServerUnaryReactor* Sample(grpc::CallbackServerContext* context,
                                   const v1::SampleRequest* request,
                                   v1::SampleResponse* response) override;
  grpc::ServerUnaryReactor* ComputeLogprobs(
      grpc::CallbackServerContext* context,
      const v1::ComputeLogprobsRequest* request,
      v1::ComputeLogprobsResponse* response) override;
  // Ordered and exactly-once like ExportWeights (seq_id > 0); charged to
  // memory admission (the model's tenant) before any rank copies anything.
  grpc::ServerUnaryReactor* SaveWeightsForSampler(
      grpc::CallbackServerContext* context,
      const v1::SaveWeightsForSamplerRequest* request,
      v1::SamplerInfo* response) override;
  // The caller's tenant's snapshots only.
  grpc::ServerUnaryReactor* ListSamplers(
      grpc::CallbackServerContext* context,
      const v1::ListSamplersRequest* request,
      v1::ListSamplersResponse* response) override;
  grpc::ServerUnaryReactor* DeleteSampler(
      grpc::CallbackServerContext* context,
      const v1::DeleteSamplerRequest* request,
      v1::SamplerInfo* response) override;

  // Artifacts (server/artifacts.h): FAILED_PRECONDITION without
  // --checkpoint-root. List and Delete run on the executor, ordered after
  // the saves queued before them; a download reads on gRPC's threads.
  grpc::ServerUnaryReactor* ListCheckpoints(
      grpc::CallbackServerContext* context,
      const v1::ListCheckpointsRequest* request,
      v1::ListCheckpointsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteCheckpoint(
      grpc::CallbackServerContext* context,
      const v1::DeleteCheckpointRequest* request,
      v1::DeleteCheckpointResponse* response) override;
  grpc::ServerWriteReactor<v1::DownloadArtifactChunk>* DownloadArtifact(
      grpc::CallbackServerContext* context,
      const v1::DownloadArtifactRequest* request) override;

 private:
  // One RPC on its way through the service. Handlers copy their request
  // (gRPC's stays as the client sent it); the fields below point into the
  // copy, which the command then executes.
  struct Call {
    const char* method;
    grpc::CallbackServerContext* context;
    // The copy's model_id, which Execute scopes to the caller's tenant (the
    // engine id); null for requests of no particular model.
    std::string* model_id = nullptr;
    uint64_t seq_id = 0;  // 0: unsequenced
    // The copy, fingerprinted when sequenced.
    const google::protobuf::Message* request = nullptr;
    google::protobuf::Message* response = nullptr;
    // An OK run ends the model's accumulation window.
    bool closes_window = false;
  };

  // Finishes the RPC with UNAUTHENTICATED for bad credentials, with
  // `validation` if it failed; otherwise scopes the call's model id to the
  // caller's tenant, queues `command` and finishes with its status once it
  // ran.
  grpc::ServerUnaryReactor* Execute(const Call& call, absl::Status validation,
                                    std::function<absl::Status()> command);
  // UNAVAILABLE once the service stopped executing or a rank failed.
  absl::Status Accepting() const;
  // Why the call must not run now, if it must not.
  absl::Status Precheck(grpc::CallbackServerContext* context) const;
  // Runs `command`, turning a collective failure into UNAVAILABLE.
  absl::Status RunCommand(const std::function<absl::Status()>& command);
  // Before a ForwardBackward runs: INVALID_ARGUMENT when its response could
  // exceed --max-message-bytes (a response that fails after the call ran
  // invites a retry that applies it twice); RESOURCE_EXHAUSTED when its
  // activations do not fit memory admission.
  absl::Status CheckCallFits(const v1::ForwardBackwardRequest& request) const;
  // INVALID_ARGUMENT over --max-tokens-per-call, on the gRPC thread.
  absl::Status CheckTokensPerCall(
      const v1::ForwardBackwardRequest& request) const;
  // The same for a Sample: prompts x num_samples x (prompt + max_tokens)
  // (SampleTokenBound), and for a ComputeLogprobs: its prompts' tokens.
  absl::Status CheckTokensPerCall(const v1::SampleRequest& request) const;
  absl::Status CheckTokensPerCall(
      const v1::ComputeLogprobsRequest& request) const;
  // The three: `tokens` against --max-tokens-per-call, the error saying
  // "<counted> <tokens> tokens, more than ...".
  absl::Status CheckTokensPerCall(int64_t tokens,
                                  absl::string_view counted) const;
  // The resident bytes per rank the model `request` creates would add (0
  // when its config cannot be read: the engine then refuses it), predicted
  // from what the engine will build: its own, and for a LoRA model whose
  // base is not in memory yet, the base's. A LoRA model is sized by the
  // base in memory under its CurrentBaseKey when there is one.
  struct CreatedBytes {
    double model = 0;
    double new_base = 0;
  };
  CreatedBytes CreatedModelBytes(const ModelSpec& spec) const;
  // Charges `model` as the engine holds it to the ledger: its resident
  // bytes, and a LoRA model's base under BaseLedgerId(base key), one entry
  // for all the adapters sharing it.
  void ChargeModel(const ModelSummary& model);
  // Charges the models the engine holds at start (resumed ones).
  void AdmitExistingModels();
  // Before SaveWeightsForSampler copies anything: ALREADY_EXISTS for a taken
  // name, RESOURCE_EXHAUSTED when the snapshot does not fit; the bytes to
  // charge once it exists.
  absl::StatusOr<double> AdmitSnapshot(
      const v1::SaveWeightsForSamplerRequest& request) const;
  // The tenant of an engine id ("" without authentication).
  std::string TenantOf(const std::string& engine_id) const;
  void PoisonForGap(const std::string& model_id);
  // On the executor thread: poisons `model_id`'s window on every rank for
  // `reason`; failures are logged (the model may be gone).
  void PoisonNow(const std::string& model_id, const std::string& reason);
  void OnRankFailure(const absl::Status& failure);
  // `engine_id`: the model's id in the engine (info holds the client's).
  void FillNextSeqId(const std::string& engine_id, v1::ModelInfo* info) const;
  // The limits this service was started with, for GetServerInfo.
  v1::ServerInfo::Limits ServerInfoLimits() const;
  // `not_found` for `engine_id`, saying why when --resume could not restore
  // that model.
  absl::Status ExplainUnresumed(const std::string& engine_id,
                                const absl::Status& not_found) const;
  // The sequencing state a checkpoint of `model_id` saves, taken on the
  // executor thread: a sequenced request executing now (the save itself, or
  // the OptimStep of a periodic checkpoint) counts as executed.
  std::string SequencingState(const std::string& model_id) const;
  void Finish(const char* method, grpc::ServerUnaryReactor* reactor,
              const absl::Status& status);
  // The caller's tenant ("" without authentication).
  absl::StatusOr<std::string> Authenticate(
      const grpc::CallbackServerContext& context);
  // Authenticate at a call's entry: a refusal is also counted
  // (tally_auth_failures_total).
  absl::StatusOr<std::string> AuthenticateCall(
      const grpc::CallbackServerContext& context);
  // Rewrites a checkpoint path (of the server's copy of a request) to its
  // confined absolute form; PERMISSION_DENIED when it escapes
  // --checkpoint-root. A tally:// handle names its path under the tenant's
  // root (FAILED_PRECONDITION without --checkpoint-root).
  absl::Status ConfinePath(const grpc::CallbackServerContext& context,
                           std::string* path);
  // The validation of a request naming a model and a directory: its
  // model_id, then `fields` (the other fields' validation), then the path
  // confined (ConfinePath on the server's copy, `path`).
  absl::Status ValidateModelAndPath(const grpc::CallbackServerContext& context,
                                    const std::string& model_id,
                                    const absl::Status& fields,
                                    std::string* path);

  // FAILED_PRECONDITION without --checkpoint-root (no artifacts).
  absl::Status ArtifactsAvailable() const;
  // After a save of `engine_id` at `step` into the confined directory `dir`:
  // records the artifact (its ttl_seconds' expiry) and returns its handle;
  // "" without --checkpoint-root.
  absl::StatusOr<std::string> RecordArtifact(const std::string& engine_id,
                                             const std::string& dir,
                                             int64_t step,
                                             uint64_t ttl_seconds);
  // A CreateModel.init_checkpoint (the server's copy) that names a model of
  // --models-root ("Org/Name", models_root.h) becomes its directory; any
  // other is confined as a path (ConfinePath).
  // A CreateModel naming a LoRA adapter's state alone: `request` rewritten
  // to the adapter over its base (server/adapter_state.h) and `spec` parsed
  // from it again.
  absl::Status ResumeAdapterState(const grpc::CallbackServerContext& context,
                                  v1::CreateModelRequest& request,
                                  absl::StatusOr<ModelSpec>& spec);
  absl::Status ResolveInitCheckpoint(const grpc::CallbackServerContext& context,
                                     std::string* init_checkpoint);

  Engine* engine_;
  CommandExecutor* executor_;
  ServerMetrics* metrics_;
  // Runs the command table on every rank, recording in metrics_.
  const CommandRunner commands_;
  const TrainerServiceOptions options_;
  RequestScheduler scheduler_;
  // Executor thread only, like the engine.
  MemoryAdmission admission_;
  // Engine id -> what --resume could not restore (executor thread only,
  // after construction).
  std::map<std::string, v1::UnresumedModel> unresumed_;
  // The sequenced request executing now (executor thread only).
  std::string executing_model_id_;
  uint64_t executing_seq_id_ = 0;
  std::atomic<bool> stopped_{false};
  mutable absl::Mutex failure_mu_;
  absl::Status rank_failure_ ABSL_GUARDED_BY(failure_mu_);
  // Set with --checkpoint-root.
  std::optional<ArtifactStore> artifacts_;
  // Deletes expired artifacts (on the executor) until StopExecuting.
  std::unique_ptr<PeriodicSweep> sweep_;
};

}  // namespace tally

#endif  // TALLY_SERVER_TRAINER_SERVICE_H_
