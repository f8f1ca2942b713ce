// Commands: the command table — every mutating command a rank executes —
// and how rank 0 hands each one to the other ranks.
//
// Each command is one CommandSpec: the request that travels to every rank,
// how a rank parses it into the engine's arguments (once: rank 0 before
// admission, ranks > 0 on receipt), the response it fills, how it executes
// on the engine and what it records in the metrics. Rank 0 runs a command
// through a CommandRunner, which broadcasts the request over the control group,
// executes it and records it; ranks > 0 run CommandLoop, which receives the
// same requests in the same order and executes them through the same specs, so
// every rank takes part in the same collectives. Read-only requests (GetModel,
// ListModels) stay on rank 0. A new command is a Command value and its spec
// (declared here, defined and listed in the table in commands.cc).
//
//   // rank 0, on the executor thread:
//   tally::CommandRunner commands(engine->control(), *engine, metrics);
//   TALLY_ASSIGN_OR_RETURN(tally::OptimStepArgs args,
//                          tally::kOptimStepCommand.parse(request));
//   TALLY_RETURN_IF_ERROR(
//       commands.Run(tally::kOptimStepCommand, request, args, &response));
//   // ranks > 0:
//   return tally::CommandLoop(*engine, engine->control(), metrics.get());
#ifndef TALLY_SERVER_COMMANDS_H_
#define TALLY_SERVER_COMMANDS_H_

#include <google/protobuf/message.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/communicator.h"
#include "server/metrics.h"
#include "server/progress_watch.h"
#include "tally/v1/internal.pb.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

// Travels to the other ranks ahead of its request: the values are the
// control group's protocol.
enum class Command : int64_t {
  kShutdown = 0,
  kCreateModel,
  kDeleteModel,
  kForwardBackward,
  kOptimStep,
  kAbortAccumulation,
  kSaveCheckpoint,
  kLoadCheckpoint,
  kPoisonWindow,
  kExportWeights,
  kSample,
  kComputeLogprobs,
  kSaveWeightsForSampler,
  kDeleteSampler,
};

// What rank 0 passes to and takes from a command beyond its request and
// response. The other ranks neither store the server's state with a
// checkpoint nor restore it, so they pass none.
struct RankZeroData {
  // SaveCheckpoint: the server's opaque state stored with the checkpoint.
  std::string server_state;
  // LoadCheckpoint, when set: receives the engine's result (the server_state
  // the checkpoint holds and the window its save dropped).
  LoadResult* loaded = nullptr;
};

// The arguments of a command that needs nothing from its request beyond
// the proto itself.
struct NoArgs {};

// An entry of the command table: a command's request, the engine arguments
// parsed from it, its response, and what a rank does with a run of it.
template <typename RequestT, typename ArgsT, typename ResponseT>
struct CommandSpec {
  using Request = RequestT;
  using Args = ArgsT;
  using Response = ResponseT;

  Command command;
  // The engine arguments of `request` (convert.h): INVALID_ARGUMENT naming
  // the field. Each rank parses a request once: rank 0 before admission (the
  // front end passes the result to CommandRunner::Run), ranks > 0 when it
  // arrives.
  absl::StatusOr<Args> (*parse)(const Request& request);
  // Executes `request`, whose arguments are `args`, on this rank's engine,
  // filling `response` on success.
  absl::Status (*execute)(Engine& engine, const Request& request,
                          const Args& args, Response* response,
                          const RankZeroData& rank_zero);
  // Rank 0: records a run that ended in `status` after `seconds` (the
  // broadcast included); `response` is filled only when `status` is OK.
  void (*record)(ServerMetrics& metrics, const Engine& engine,
                 const Request& request, const Response& response,
                 const absl::Status& status, double seconds);
  // Ranks > 0: the histogram that an OK run's seconds go to (null: none).
  // These ranks refresh their rank state after every run either way.
  void (ServerMetrics::*observe_seconds)(const std::string& model_id,
                                         double seconds);
};

// The command table: an entry per Command but kShutdown. Responses are the
// client's, except where noted.
extern const CommandSpec<v1::CreateModelRequest, ModelSpec, v1::ModelInfo>
    kCreateModelCommand;
extern const CommandSpec<v1::DeleteModelRequest, NoArgs,
                         v1::DeleteModelResponse>
    kDeleteModelCommand;
// Counts the window poisoned when the call's failure poisoned it.
extern const CommandSpec<v1::ForwardBackwardRequest, ForwardBackwardArgs,
                         v1::ForwardBackwardResponse>
    kForwardBackwardCommand;
// Counts the window poisoned when the step's failure poisoned it.
extern const CommandSpec<v1::OptimStepRequest, OptimStepArgs,
                         v1::OptimStepResponse>
    kOptimStepCommand;
extern const CommandSpec<v1::AbortAccumulationRequest, NoArgs,
                         v1::AbortAccumulationResponse>
    kAbortAccumulationCommand;
// Stores RankZeroData::server_state with the checkpoint.
extern const CommandSpec<v1::SaveCheckpointRequest, NoArgs,
                         v1::SaveCheckpointResponse>
    kSaveCheckpointCommand;
// Fills RankZeroData::loaded.
extern const CommandSpec<v1::LoadCheckpointRequest, NoArgs,
                         v1::LoadCheckpointResponse>
    kLoadCheckpointCommand;
// Weights only: does not close the window (Engine::ExportWeights).
extern const CommandSpec<v1::ExportWeightsRequest, ExportOptions,
                         v1::ExportWeightsResponse>
    kExportWeightsCommand;
// Weights only, as ExportWeights: the window stays as it is
// (Engine::Sample). A request without a seed is sampled with one the engine
// draws and returns.
extern const CommandSpec<v1::SampleRequest, SampleArgs, v1::SampleResponse>
    kSampleCommand;
extern const CommandSpec<v1::ComputeLogprobsRequest, LogprobsArgs,
                         v1::ComputeLogprobsResponse>
    kComputeLogprobsCommand;
// Sampler snapshots (Engine::SaveWeightsForSampler, DeleteSampler): every
// rank copies or frees its own shard. Rank 0's response describes its copy.
extern const CommandSpec<v1::SaveWeightsForSamplerRequest, NoArgs,
                         v1::SamplerInfo>
    kSaveWeightsForSamplerCommand;
extern const CommandSpec<v1::DeleteSamplerRequest, NoArgs, v1::SamplerInfo>
    kDeleteSamplerCommand;
// Poisons the window of request.model_id for request.reason (quoted by the
// OptimStep it fails). The response says whether this run poisoned it (false:
// it already was); rank 0 counts the window poisoned when it did.
extern const CommandSpec<v1::internal::PoisonWindowCommand, NoArgs, bool>
    kPoisonWindowCommand;

// SaveCheckpoint and LoadCheckpoint on this engine alone: what their table
// entries execute on every rank. `server_state`: the opaque bytes of the
// server saved with the checkpoint. `loaded`, when given, receives the
// engine's result.
absl::Status ExecuteSaveCheckpoint(Engine& engine,
                                   const v1::SaveCheckpointRequest& request,
                                   v1::SaveCheckpointResponse* response,
                                   const std::string& server_state = "");
absl::Status ExecuteLoadCheckpoint(Engine& engine,
                                   const v1::LoadCheckpointRequest& request,
                                   v1::LoadCheckpointResponse* response,
                                   LoadResult* loaded = nullptr);

// Rank 0: sends (command, serialized request) to every rank. A no-op in a
// single-rank deployment.
absl::Status ReplicateCommand(Communicator& control, Command command,
                              const google::protobuf::Message& request);

// Rank 0's end of the command table: runs an entry on every rank.
class CommandRunner {
 public:
  // `metrics` null: runs record nothing (for callers that record their own,
  // like the Checkpointer).
  CommandRunner(Communicator& control, Engine& engine, ServerMetrics* metrics)
      : control_(control), engine_(engine), metrics_(metrics) {}

  // Broadcasts `request` to the other ranks, executes it here with `args`
  // (the entry's parse of `request`, done once by the caller) and records
  // the run.
  template <typename Request, typename Args, typename Response>
  absl::Status Run(const CommandSpec<Request, Args, Response>& command,
                   const Request& request, const Args& args, Response* response,
                   const RankZeroData& rank_zero = {}) const {
    const absl::Time start = absl::Now();
    absl::Status status = ReplicateCommand(control_, command.command, request);
    if (status.ok()) {
      status = command.execute(engine_, request, args, response, rank_zero);
    }
    Record(command, request, *response, status, start);
    return status;
  }

  // The same for a request nobody parsed yet: parses it first (a request it
  // refuses is recorded as a failed run and reaches no rank).
  template <typename Request, typename Args, typename Response>
  absl::Status Run(const CommandSpec<Request, Args, Response>& command,
                   const Request& request, Response* response,
                   const RankZeroData& rank_zero = {}) const {
    const absl::Time start = absl::Now();
    const absl::StatusOr<Args> args = command.parse(request);
    if (!args.ok()) {
      Record(command, request, *response, args.status(), start);
      return args.status();
    }
    return Run(command, request, *args, response, rank_zero);
  }

 private:
  template <typename Request, typename Args, typename Response>
  void Record(const CommandSpec<Request, Args, Response>& command,
              const Request& request, const Response& response,
              const absl::Status& status, absl::Time start) const {
    if (metrics_ == nullptr) return;
    command.record(*metrics_, engine_, request, response, status,
                   absl::ToDoubleSeconds(absl::Now() - start));
  }

  Communicator& control_;
  Engine& engine_;
  ServerMetrics* metrics_;
};

// Rank 0, after a load that continues the checkpoint's seq_ids: the calls of
// the window the checkpoint's save dropped (allow_pending) count as
// executed, so a client resuming at next_seq_id would step on a window
// missing them. Poisons the window on every rank, the next OptimStep quoting
// "<cause> a checkpoint that dropped N pending ForwardBackward calls"; a
// no-op when nothing was dropped. Not counted as a poisoned window in the
// metrics, which count failed calls and sequence gaps.
absl::Status PoisonDroppedWindow(Communicator& control, Engine& engine,
                                 const std::string& model_id,
                                 const WindowCounts& dropped,
                                 absl::string_view cause);

// Ranks > 0: executes replicated commands until kShutdown. Failures that can
// differ between ranks are agreed inside the engine, so a failed command
// failed on rank 0 too and is only logged; a failed collective (a dead or hung
// rank, Engine::CollectiveFailure) or a broken control group ends the loop
// with its error. `metrics` (nullable) gets this rank's execution times and
// state after every command; `progress` (nullable) marks each one running.
absl::Status CommandLoop(Engine& engine, Communicator& control,
                         ServerMetrics* metrics,
                         ProgressWatch* progress = nullptr);

}  // namespace tally

#endif  // TALLY_SERVER_COMMANDS_H_
