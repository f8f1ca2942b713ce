// PipelineExecutor: runs one pipeline stage's part of a call — its forwards
// and backwards of every micro-batch, in 1F1B order (forwards only for a
// forward-only call) — and owns the traffic between stages: activations go
// to the next stage, their gradients come back to the previous one.
//
// A send is fused with the receive from the same peer that the next step
// needs (as Megatron does), so two neighbours exchanging never wait on each
// other's send. Every stage planned the same micro-batches, so each knows
// the shape of what it receives. With one stage it is a plain loop of
// forward, backward. A stage whose callback fails keeps its transfers going
// to the end, so one rank's failure never leaves a neighbour waiting for a
// transfer.
//
//   tally::StageCallbacks stage;
//   stage.boundary_like = [&](size_t b) { return torch::empty(shape(b)); };
//   stage.forward = [&](size_t b, const torch::Tensor& input) {
//     return model.StageForward(...);  // the next stage's input, or the loss
//   };
//   TALLY_RETURN_IF_ERROR(tally::RunStageSchedule(pp, num_batches,
//                                                 /*backward=*/true, stage));
#ifndef TALLY_RUNTIME_PARALLEL_PIPELINE_EXECUTOR_H_
#define TALLY_RUNTIME_PARALLEL_PIPELINE_EXECUTOR_H_

#include <torch/torch.h>

#include <cstddef>
#include <functional>

#include "absl/status/status.h"
#include "runtime/parallel/communicator.h"

namespace tally {

struct StageCallbacks {
  // An uninitialized tensor of the shape that flows between stages for
  // micro-batch b (activations and their gradients alike), to receive into.
  std::function<torch::Tensor(size_t b)> boundary_like;
  // This stage's forward of micro-batch b. `input`: what the previous stage
  // sent (undefined on the first stage; it requires grad when backward
  // follows). Returns what goes on to the next stage or, on the last stage,
  // the scalar to backpropagate.
  std::function<torch::Tensor(size_t b, const torch::Tensor& input)> forward;
  // Optional: right before micro-batch b's backward. Backwards run in
  // micro-batch order.
  std::function<void(size_t b)> before_backward;
  // Optional, with backward: called by every stage right before its last
  // backward with the stage's failure so far (OK when none); returns what
  // the ranks agree (AgreeOnStatus over the ranks of this stage whose
  // collectives the last backward starts, e.g. its gradient sums). That
  // becomes the stage's failure: on an error no rank starts what a failed
  // peer would not finish. (Never a group spanning stages: a neighbour may
  // wait for this stage's last backward before it can agree.)
  std::function<absl::Status(absl::Status so_far)> agree;
  // Optional: called once, with the error, when a callback or a backward of
  // this stage first fails (its own error, or a collective's inside it; not
  // a transfer between stages), before the stage sends its zeros.
  std::function<void(const absl::Status& failure)> failed;
};

// `pp`: this rank's pipeline group (group rank = stage). Without `backward`
// the forwards run under torch::NoGradGuard. A callback that throws does not
// stop the stage at once: it runs no more callbacks but keeps its transfers
// going, sending zeros, so that its neighbours finish their part, then
// returns INTERNAL naming the error (or what `agree` returned). A failed
// transfer ends it at once with INTERNAL (the group is broken; peers then
// fail on their own transfers).
absl::Status RunStageSchedule(Communicator& pp, size_t num_batches,
                              bool backward, const StageCallbacks& callbacks);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_PIPELINE_EXECUTOR_H_
