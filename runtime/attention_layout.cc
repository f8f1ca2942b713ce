#include "runtime/attention_layout.h"

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

}  // namespace tally
