// AttentionLayout: which keys each query of a packed [B, T] batch may read,
// as data, so the engine's call plan, context parallelism and every model
// family agree on it without knowing each other.
//
//   tally::AttentionLayout layout =
//       tally::AttentionLayout::RightPadded({3, 5}, /*seq=*/5);
//   // row 0: keys 0..2 valid; row 1: keys 0..4 valid; causal by position
#ifndef TALLY_RUNTIME_MODEL_ATTENTION_LAYOUT_H_
#define TALLY_RUNTIME_MODEL_ATTENTION_LAYOUT_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace tally {

// Where each token of a [B, T] batch sits in its sample, and which keys its
// query may read: key j of row b is visible to query i iff key_valid[b, j]
// and key_positions[b, j] <= positions[b, i]. Under context parallelism the
// keys are those of every cp rank (K = cp * T); otherwise they are the row's
// own tokens (K = T). Padding queries must be placed at or after their
// sample's last position, so that they see a key (under a sliding window
// they may see none: the materialized path then lets them see their causal
// keys, the blocked one gives zeros; either way they stay finite, and
// padding outputs reach no loss or gradient).
struct AttentionLayout {
  torch::Tensor positions;      // [B, T] int64
  torch::Tensor key_positions;  // [B, K] int64
  torch::Tensor key_valid;      // [B, K] bool

  // Whole samples, right-padded to `seq`: positions 0..seq-1 on every row
  // and keys valid below each row's length.
  static AttentionLayout RightPadded(const std::vector<int64_t>& lengths,
                                     int64_t seq);

  // [B, T, end - begin] bool: whether each query sees each of the keys
  // [begin, end) (real, at or before it, and with `window` > 0 less than
  // `window` positions before it, HF's sliding window).
  torch::Tensor VisibleKeys(int64_t window, int64_t begin, int64_t end) const;

  // The same layout with its tensors on `device`.
  AttentionLayout To(const torch::Device& device) const;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_ATTENTION_LAYOUT_H_
