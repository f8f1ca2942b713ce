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
#ifndef TALLY_RUNTIME_PARAMETER_H_
#define TALLY_RUNTIME_PARAMETER_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/placement.h"

namespace tally {

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
};

}  // namespace tally

#endif  // TALLY_RUNTIME_PARAMETER_H_
