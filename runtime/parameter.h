// Parameter: one trainable tensor of a model as the rest of the runtime sees
// it — its HF name, this rank's local shard and how the full tensor is laid
// out over the mesh. The optimizer, the gradient norm, gradient buckets, the
// accumulation window and checkpoints work on Parameters, never on a model
// class, so a new model family only has to produce them.
//
//   int64_t local = 0;
//   for (const tally::Parameter& p : model.parameters()) {
//     local += p.tensor.numel();  // this rank's shard of p.full_shape
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
  std::string name;      // HF name, e.g. "model.layers.0.mlp.up_proj.weight"
  torch::Tensor tensor;  // this rank's local shard; requires_grad
  Placements placements;
  bool is_expert = false;
  std::vector<int64_t> full_shape;  // the HF (unsharded) shape
  // After the tp split, before the dp_shard split: what the forward pass
  // gathers the dp_shard shards back into.
  std::vector<int64_t> tp_local_shape;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_PARAMETER_H_
