// FaultHook: a test-only seam that makes chosen points of the engine's
// commands fail on a chosen rank, to show that a failure seen by one rank
// only (an exception, a refused allocation) fails the command on every rank
// with the same status and leaves the ranks able to run the next one.
// The hook is per process (a rank is a process): production processes have
// none, as only tests call SetFaultHook and no flag or variable of the server
// sets one.
//
//   tally::SetFaultHook([rank](tally::FaultPoint point) {
//     return rank == 1 && point == tally::FaultPoint::kForward
//                ? absl::ResourceExhaustedError("injected")
//                : absl::OkStatus();
//   });
#ifndef TALLY_RUNTIME_PARALLEL_FAULT_HOOK_H_
#define TALLY_RUNTIME_PARALLEL_FAULT_HOOK_H_

#include <functional>

#include "absl/status/status.h"

namespace tally {

// Where the engine consults the hook; an error there acts as a local
// failure of that step on this rank.
enum class FaultPoint {
  kBuildModel,       // CreateModel, building this rank's part of the model
  kForward,          // ForwardBackward, each micro-batch's forward (throws)
  kBackward,         // ForwardBackward, each micro-batch's backward (throws)
  kGradNorm,         // OptimStep, this rank's part of the gradient norm
  kOptimizerUpdate,  // OptimStep, this rank's update of its parameters
  kGather,           // SaveCheckpoint / ExportWeights, before each tensor
                     // this rank helps gather for the writer
  kWrite,            // SaveCheckpoint / ExportWeights, before the write
  kLoad,             // LoadCheckpoint, reading and staging the checkpoint
  kLoadCopy,         // LoadCheckpoint (and an init_checkpoint), before each
                     // tensor copied into the model
  kGradientSync,     // ZeRO-1's gradient sum, before each parameter's
                     // reduce-scatter over dp_shard
  kRefreshGathered,  // ZeRO-1/2, before each gather of the kept copies
                     // (CreateModel, LoadCheckpoint, OptimStep's update)
};

using FaultHook = std::function<absl::Status(FaultPoint point)>;

// Tests only: the hook of this process from now on (empty: none). Install
// it before the commands it is for, not while one runs.
void SetFaultHook(FaultHook hook);

// The engine, at `point`: the hook's verdict, OK without a hook.
absl::Status InjectedFault(FaultPoint point);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_FAULT_HOOK_H_
