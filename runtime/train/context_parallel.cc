#include "runtime/train/context_parallel.h"

#include <algorithm>

namespace tally {

std::vector<int64_t> ContextParallelPositions(int64_t length, int cp_rank,
                                              int cp_size) {
  const int64_t chunks = 2 * static_cast<int64_t>(cp_size);
  std::vector<int64_t> positions;
  for (int64_t chunk : {static_cast<int64_t>(cp_rank), chunks - 1 - cp_rank}) {
    for (int64_t t = chunk * length / chunks; t < (chunk + 1) * length / chunks;
         ++t) {
      positions.push_back(t);
    }
  }
  return positions;
}

ContextParallelBatch SplitForContextParallel(const PackedBatch& batch,
                                             int cp_rank, int cp_size) {
  const int64_t rows = static_cast<int64_t>(batch.lengths.size());
  std::vector<std::vector<std::vector<int64_t>>> positions(cp_size);
  int64_t block = 1;  // never empty, so every collective has a shape
  for (int r = 0; r < cp_size; ++r) {
    for (int64_t length : batch.lengths) {
      positions[r].push_back(ContextParallelPositions(length, r, cp_size));
      block = std::max(block, static_cast<int64_t>(positions[r].back().size()));
    }
  }
  // [C, B, block]: each rank's positions, padded with the sample length.
  torch::Tensor where = torch::empty({cp_size, rows, block}, torch::kInt64);
  torch::Tensor present = torch::zeros({cp_size, rows, block}, torch::kBool);
  auto where_a = where.accessor<int64_t, 3>();
  auto present_a = present.accessor<bool, 3>();
  for (int r = 0; r < cp_size; ++r) {
    for (int64_t b = 0; b < rows; ++b) {
      const std::vector<int64_t>& mine = positions[r][b];
      for (int64_t t = 0; t < block; ++t) {
        const bool real = t < static_cast<int64_t>(mine.size());
        where_a[r][b][t] = real ? mine[t] : batch.lengths[b];
        present_a[r][b][t] = real;
      }
    }
  }

  ContextParallelBatch split;
  const torch::Tensor here = present[cp_rank];
  const torch::Tensor index = where[cp_rank].masked_fill(~here, 0);
  PackedBatch& local = split.local;
  local.sample_index = batch.sample_index;
  for (int64_t b = 0; b < rows; ++b) {
    local.lengths.push_back(static_cast<int64_t>(positions[cp_rank][b].size()));
  }
  local.inputs = batch.inputs.gather(1, index).masked_fill(~here, 0);
  local.targets = batch.targets.gather(1, index).masked_fill(~here, 0);
  local.has_target = batch.has_target.gather(1, index) & here;
  local.weights = batch.weights.gather(1, index).masked_fill(~here, 0);
  local.valid = batch.valid.gather(1, index) & here;
  for (const auto& [name, values] : batch.token_inputs) {
    local.token_inputs[name] = values.gather(1, index).masked_fill(~here, 0);
  }

  split.layout.positions = where[cp_rank];
  split.layout.key_positions =
      where.permute({1, 0, 2}).reshape({rows, cp_size * block});
  split.layout.key_valid =
      present.permute({1, 0, 2}).reshape({rows, cp_size * block});
  return split;
}

}  // namespace tally
