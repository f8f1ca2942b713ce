// CallPlan: how the samples of one ForwardBackward call meet this rank.
//
// Samples are split over the ranks that hold distinct data (balanced by
// valid tokens); tp, cp and pp peers see the same ones, and cp peers each
// take a part of every sample's tokens. Each data rank's share is cut into
// `pipeline_parts` contiguous parts (the pipeline's micro-batches), each
// batched by `max_batch_tokens`. Every data rank runs as many micro-batches
// as the busiest one, padding with empty ones, because the forward pass
// gathers dp_shard parameters collectively. Every micro-batch is packed (and
// split over cp) up front: under cp, SAMPLE_MEAN needs each sample's whole
// token count T_b before the first backward, and that takes one cp
// collective for the whole call.
//
//   TALLY_ASSIGN_OR_RETURN(tally::CallPlan plan,
//                          tally::PlanCall(samples, options, data, cp));
//   for (size_t b = 0; b < plan.packed.size(); ++b) {
//     if (!plan.real(b)) ...  // padding: run it, count nothing
//     model.StageForward(plan.packed[b].inputs, ..., plan.layouts[b], ...);
//   }
#ifndef TALLY_RUNTIME_TRAIN_CALL_PLAN_H_
#define TALLY_RUNTIME_TRAIN_CALL_PLAN_H_

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/config/types.h"
#include "runtime/model/attention_layout.h"
#include "runtime/parallel/communicator.h"
#include "runtime/train/loss.h"

namespace tally {

struct CallPlanOptions {
  LossReduction reduction = LossReduction::kTokenMean;
  torch::ScalarType dtype = torch::kFloat32;  // of the packed weights
  int pipeline_parts = 1;  // micro-batches per data rank before batching
  int64_t max_batch_tokens = 16384;
  // Where the micro-batches and layouts go (the model's device).
  torch::Device device = torch::kCPU;
};

struct CallPlan {
  // This rank's micro-batches: packed rows (this cp rank's chunk of them)
  // and their attention layouts. The first `real_batches` hold samples; the
  // rest are padding that runs so the collectives line up.
  std::vector<PackedBatch> packed;
  std::vector<AttentionLayout> layouts;
  size_t real_batches = 0;
  // SAMPLE_MEAN under cp: every sample's valid-token count T_b over the
  // whole cp group, [num_samples] fp64. Undefined otherwise (rows hold whole
  // samples, whose own counts are T_b).
  torch::Tensor sample_tokens;

  size_t num_batches() const { return packed.size(); }
  bool real(size_t b) const { return b < real_batches; }
  // T_b of each row of micro-batch b, [rows] int64 on the batch's device,
  // for ComputeLoss; undefined when sample_tokens is or for padding.
  torch::Tensor RowTokens(size_t b) const;
};

// `data`: the ranks holding distinct samples; `cp`: this rank's context
// parallel group (one collective under SAMPLE_MEAN with cp > 1).
absl::StatusOr<CallPlan> PlanCall(const std::vector<Sample>& samples,
                                  const CallPlanOptions& options,
                                  Communicator& data, Communicator& cp);

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_CALL_PLAN_H_
