#include "runtime/train/loss_batch.h"

#include <algorithm>

namespace tally {

PackedBatch PackRows(const std::vector<Sample>& samples,
                     const std::vector<int>& rows, torch::ScalarType dtype) {
  PackedBatch batch;
  batch.sample_index = rows;
  int64_t seq = 0;
  for (int r : rows) {
    const int64_t len = static_cast<int64_t>(samples[r].input_tokens.size());
    batch.lengths.push_back(len);
    seq = std::max(seq, len);
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  batch.inputs = torch::zeros({n, seq}, torch::kInt64);
  batch.targets = torch::zeros({n, seq}, torch::kInt64);
  torch::Tensor weights = torch::zeros({n, seq}, torch::kFloat64);
  batch.has_target = torch::zeros({n, seq}, torch::kBool);
  batch.valid = torch::zeros({n, seq}, torch::kBool);
  auto has_target = batch.has_target.accessor<bool, 2>();
  auto inputs = batch.inputs.accessor<int64_t, 2>();
  auto targets = batch.targets.accessor<int64_t, 2>();
  auto w = weights.accessor<double, 2>();
  auto valid = batch.valid.accessor<bool, 2>();
  for (int64_t b = 0; b < n; ++b) {
    const Sample& s = samples[rows[b]];
    for (size_t t = 0; t < s.input_tokens.size(); ++t) {
      inputs[b][t] = s.input_tokens[t];
      if (s.target_tokens[t] == kIgnoreIndex) continue;
      targets[b][t] = s.target_tokens[t];
      has_target[b][t] = true;
      const double weight = s.weights.empty() ? 1.0 : s.weights[t];
      if (weight != 0) {
        w[b][t] = weight;
        valid[b][t] = true;
      }
    }
  }
  batch.weights = weights.to(dtype);
  for (int64_t b = 0; b < n; ++b) {
    for (const auto& [name, values] : samples[rows[b]].token_inputs) {
      torch::Tensor& packed = batch.token_inputs[name];
      if (!packed.defined()) packed = torch::zeros({n, seq}, torch::kFloat64);
      packed[b]
          .narrow(0, 0, static_cast<int64_t>(values.size()))
          .copy_(torch::tensor(values, torch::kFloat64));
    }
  }
  for (auto& [name, packed] : batch.token_inputs) packed = packed.to(dtype);
  return batch;
}

PackedBatch PackedBatch::To(const torch::Device& device) const {
  PackedBatch moved;
  moved.sample_index = sample_index;
  moved.lengths = lengths;
  moved.inputs = inputs.to(device);
  moved.targets = targets.to(device);
  moved.has_target = has_target.to(device);
  moved.weights = weights.to(device);
  moved.valid = valid.to(device);
  for (const auto& [name, values] : token_inputs) {
    moved.token_inputs[name] = values.to(device);
  }
  return moved;
}

}  // namespace tally
