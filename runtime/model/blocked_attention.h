// Blocked attention: softmax(q kᵀ / √d, masked) v computed one block of keys
// at a time with an online softmax (the running maximum and sum of
// FlashAttention's recurrence), forward and backward. Backward recomputes
// each block's probabilities from the saved per-query log-sum-exp instead of
// keeping them, so the extra memory of a layer is O(T × block) per head
// rather than the O(T × K) score and probability matrices of the
// materialized path. Same math: equal to the materialized softmax to
// rounding (fp64 goldens at 1e-10).
//
// The mask is built per block from the AttentionLayout's positions (causal
// by position, padding keys hidden, an optional sliding window), so no
// [T, K] mask exists either; context parallelism's gathered keys work as
// they are. A query that sees no key at all (only padding can) gets zeros.
//
//   tally::AttentionOptions options;  // kAuto: blocked from 2048 keys
//   if (options.Blocked(k.size(2))) {
//     out = tally::BlockedAttention(q, k, v, layout, /*window=*/0,
//                                   options.block_keys);
//   }
#ifndef TALLY_RUNTIME_MODEL_BLOCKED_ATTENTION_H_
#define TALLY_RUNTIME_MODEL_BLOCKED_ATTENTION_H_

#include <torch/torch.h>

#include <cstdint>

#include "runtime/config/types.h"
#include "runtime/model/attention_layout.h"

namespace tally {

// q [B, H, T, d], k and v [B, H, K, d] (kv heads already repeated for
// GQA); `layout` gives the positions of the T queries and K keys and which
// keys are real; `window` > 0 limits a query to the keys less than `window`
// positions before it (HF's sliding window). The softmax runs in float32 at
// least, the matmuls in the inputs' dtype. Returns [B, H, T, d] in q's
// dtype; differentiable in q, k and v.
torch::Tensor BlockedAttention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v,
                               const AttentionLayout& layout, int64_t window,
                               int64_t block_keys);

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_BLOCKED_ATTENTION_H_
