// PackedBatch: a micro-batch of samples right-padded into [B, T] tensors,
// with the per-token inputs a loss reads (weights, Sample::token_inputs)
// packed alongside. What a TokenLoss (token_loss.h) reads and ComputeLoss
// (loss.h) reduces; it depends on neither.
//
//   tally::PackedBatch batch = tally::PackRows(samples, {0, 2},
//   torch::kFloat32); batch.valid;  // [2, T] bool: the tokens that count
#ifndef TALLY_RUNTIME_TRAIN_LOSS_BATCH_H_
#define TALLY_RUNTIME_TRAIN_LOSS_BATCH_H_

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime/config/types.h"

namespace tally {

// Samples right-padded into one [B, T] batch.
struct PackedBatch {
  std::vector<int> sample_index;  // row b holds samples[sample_index[b]]
  std::vector<int64_t> lengths;   // real length of each row
  torch::Tensor inputs;           // [B, T] int64, padding 0
  torch::Tensor targets;          // [B, T] int64, -100 and padding -> 0
  torch::Tensor has_target;       // [B, T] bool: a real target, not -100
  torch::Tensor weights;          // [B, T] model dtype, 0 where not valid
  torch::Tensor valid;            // [B, T] bool: has_target and weight != 0
  // Sample::token_inputs by name, [B, T] model dtype, 0 at padding; each
  // present when any of the rows' samples has it.
  std::map<std::string, torch::Tensor> token_inputs;

  // The same batch with its tensors on `device`.
  PackedBatch To(const torch::Device& device) const;
};

// Pads samples[rows] into one batch.
PackedBatch PackRows(const std::vector<Sample>& samples,
                     const std::vector<int>& rows, torch::ScalarType dtype);

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_LOSS_BATCH_H_
