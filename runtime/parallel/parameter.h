// Parameter: one tensor of a model as the rest of the runtime sees it — its
// HF name, this rank's local shard, how the full tensor is laid out over the
// mesh, and whether it trains. A frozen parameter (a LoRA base, a frozen
// embedding) takes no gradient, no optimizer state, no gradient bucket and
// no slot in the norm, and a trainable-only checkpoint leaves it out. The
// optimizer, the gradient norm, gradient buckets, the accumulation window and
// checkpoints work on Parameters, never on a model class, so a new model
// family only has to produce them.
//
//   int64_t local = 0;
//   for (const tally::Parameter& p : model.parameters()) {
//     if (p.trainable) local += p.tensor.numel();  // a shard of p.full_shape
//   }
#ifndef TALLY_RUNTIME_PARALLEL_PARAMETER_H_
#define TALLY_RUNTIME_PARALLEL_PARAMETER_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/parallel/placement.h"

namespace tally {

// ZeRO stages 1 and 2 (runtime/parallel/zero.h): a dp_shard-sharded parameter
// kept gathered between optimizer steps, shared by every copy of its Parameter
// (a LoRA adapter's frozen base parameters share the base's).
struct GatheredCopy {
  // Stage 1: the gradient stays whole on each rank until the window is
  // summed (`grad`); stage 2: each pass reduce-scatters it into the shard.
  bool whole_gradient = false;
  // The tp-local parameter, gathered over dp_shard in the compute dtype;
  // undefined until the first RefreshGatheredCopies.
  torch::Tensor value;
  // Stage 1: this rank's own gradient of `value` summed over its backward
  // passes, in the parameter's dtype, not yet reduced over dp_shard;
  // allocated by the first backward, zeroed (not freed) by each reduction.
  torch::Tensor grad;
};

struct Parameter {
  std::string name;  // HF name, e.g. "model.layers.0.mlp.up_proj.weight"
  // This rank's local shard; requires_grad exactly when trainable.
  torch::Tensor tensor;
  Placements placements;
  bool is_expert = false;
  bool trainable = true;
  std::vector<int64_t> full_shape;  // the HF (unsharded) shape
  // After the tp split, before the dp_shard split: what the forward pass
  // gathers the dp_shard shards back into.
  std::vector<int64_t> tp_local_shape;
  // Set when the parameter is dp_shard-sharded under ZeRO stage 1 or 2.
  std::shared_ptr<GatheredCopy> gathered;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_PARAMETER_H_
