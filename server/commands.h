// Commands: what every rank executes for a mutating request, and how rank 0
// hands each one to the other ranks.
//
// Rank 0 validates a request, broadcasts it over the control group, then
// executes it; ranks > 0 run CommandLoop, which receives the same requests in
// the same order and executes them through the same functions, so every rank
// takes part in the same collectives. Read-only requests (GetModel,
// ListModels) stay on rank 0.
//
//   // rank 0, on the executor thread:
//   TALLY_RETURN_IF_ERROR(ReplicateCommand(control, Command::kOptimStep, req));
//   TALLY_RETURN_IF_ERROR(ExecuteOptimStep(engine, req, &resp));
//   // ranks > 0:
//   return tally::CommandLoop(engine, control, metrics.get());
#ifndef TALLY_SERVER_COMMANDS_H_
#define TALLY_SERVER_COMMANDS_H_

#include <google/protobuf/message.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "runtime/communicator.h"
#include "runtime/engine.h"
#include "server/metrics.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

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
};

// Engine execution of each mutating request; responses filled on success.
// Requests must already have passed the proto-level validation in
// convert.h.
absl::Status ExecuteCreateModel(Engine& engine,
                                const v1::CreateModelRequest& request,
                                v1::ModelInfo* response);
absl::Status ExecuteDeleteModel(Engine& engine,
                                const v1::DeleteModelRequest& request,
                                v1::DeleteModelResponse* response);
absl::Status ExecuteForwardBackward(Engine& engine,
                                    const v1::ForwardBackwardRequest& request,
                                    v1::ForwardBackwardResponse* response);
absl::Status ExecuteOptimStep(Engine& engine,
                              const v1::OptimStepRequest& request,
                              v1::OptimStepResponse* response);
absl::Status ExecuteAbortAccumulation(
    Engine& engine, const v1::AbortAccumulationRequest& request,
    v1::AbortAccumulationResponse* response);
// `server_state`: opaque bytes of the server saved with the checkpoint (rank
// 0 writes; other ranks pass nothing).
absl::Status ExecuteSaveCheckpoint(Engine& engine,
                                   const v1::SaveCheckpointRequest& request,
                                   v1::SaveCheckpointResponse* response,
                                   const std::string& server_state = "");
// `loaded`, when given, receives the engine's result: the server_state the
// checkpoint holds and the window its save dropped.
absl::Status ExecuteLoadCheckpoint(Engine& engine,
                                   const v1::LoadCheckpointRequest& request,
                                   v1::LoadCheckpointResponse* response,
                                   LoadResult* loaded = nullptr);

// Poisons the window of request.model_id, for `reason` (quoted by the
// OptimStep it fails); `response` is the model after it. Rank 0 poisons a
// window when a sequenced request of it never arrived (sequencer.h) or when
// --resume restored a checkpoint that dropped it (checkpointer.h); the other
// ranks only need the flag.
inline constexpr char kGapPoisonReason[] =
    "a sequenced request of the window did not arrive within "
    "--seq-gap-timeout";
absl::Status ExecutePoisonWindow(Engine& engine,
                                 const v1::GetModelRequest& request,
                                 v1::ModelInfo* response,
                                 const std::string& reason);

// Rank 0, after a load that continues the checkpoint's seq_ids: the calls of
// the window the checkpoint's save dropped (allow_pending) count as
// executed, so a client resuming at next_seq_id would step on a window
// missing them. Poisons the window on every rank, the next OptimStep quoting
// "<cause> a checkpoint that dropped N pending ForwardBackward calls"; a
// no-op when nothing was dropped.
absl::Status PoisonDroppedWindow(Communicator& control, Engine& engine,
                                 const std::string& model_id,
                                 const WindowCounts& dropped,
                                 absl::string_view cause);

// Rank 0: sends (command, serialized request) to every rank. A no-op in a
// single-rank deployment.
absl::Status ReplicateCommand(Communicator& control, Command command,
                              const google::protobuf::Message& request);

// Ranks > 0: executes replicated commands until kShutdown. Failures that can
// differ between ranks are agreed inside the engine, so a failed command
// failed on rank 0 too and is only logged; a failed collective (a dead or hung
// rank, Engine::CollectiveFailure) or a broken control group ends the loop
// with its error. `metrics` (nullable) gets this rank's execution times and
// state after every command.
absl::Status CommandLoop(Engine& engine, Communicator& control,
                         ServerMetrics* metrics);

}  // namespace tally

#endif  // TALLY_SERVER_COMMANDS_H_
