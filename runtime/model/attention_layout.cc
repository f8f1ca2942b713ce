#include "runtime/model/attention_layout.h"

namespace tally {

AttentionLayout AttentionLayout::RightPadded(
    const std::vector<int64_t>& lengths, int64_t seq) {
  const int64_t batch = static_cast<int64_t>(lengths.size());
  AttentionLayout layout;
  layout.positions = torch::arange(seq).expand({batch, seq});
  layout.key_positions = layout.positions;
  layout.key_valid = layout.positions < torch::tensor(lengths).unsqueeze(1);
  return layout;
}

torch::Tensor AttentionLayout::VisibleKeys(int64_t window, int64_t begin,
                                           int64_t end) const {
  const torch::Tensor distance =
      positions.unsqueeze(2) - key_positions.slice(1, begin, end).unsqueeze(1);
  torch::Tensor visible =
      key_valid.slice(1, begin, end).unsqueeze(1) & (distance >= 0);
  return window > 0 ? visible & (distance < window) : visible;
}

AttentionLayout AttentionLayout::To(const torch::Device& device) const {
  AttentionLayout moved;
  moved.positions = positions.to(device);
  // Whole samples share one tensor: keep sharing it on the device.
  moved.key_positions = key_positions.is_same(positions)
                            ? moved.positions
                            : key_positions.to(device);
  moved.key_valid = key_valid.to(device);
  return moved;
}

}  // namespace tally
