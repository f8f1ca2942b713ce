// Context parallelism: how the tokens of a packed batch are split over the C
// ranks of a cp group.
//
// Each sample of L tokens is cut into 2C contiguous chunks (chunk j covers
// [j L / 2C, (j + 1) L / 2C), rounded down), and cp rank i keeps chunks i and
// 2C - 1 - i. Under a causal mask the early chunks are cheap and the late ones
// expensive, so pairing them gives every rank the same attention work. A
// sample shorter than 2C tokens leaves some chunks empty; its rank still joins
// every collective with padding rows.
//
// Every rank of the group sees the same batch and splits it the same way, so
// each can compute every other rank's token positions without communication:
// the attention layout names the keys of all cp ranks in the order the K/V
// gather (GatherSequenceBlocks) concatenates them.
//
//   tally::ContextParallelBatch split =
//       tally::SplitForContextParallel(batch, cp.rank(), cp.size());
//   torch::Tensor logprobs = model.TargetLogprobs(
//       split.local.inputs, split.local.targets, split.layout);
#ifndef TALLY_RUNTIME_TRAIN_CONTEXT_PARALLEL_H_
#define TALLY_RUNTIME_TRAIN_CONTEXT_PARALLEL_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "runtime/model/attention_layout.h"
#include "runtime/train/loss.h"

namespace tally {

// Positions in a sample of `length` tokens that cp rank `cp_rank` of
// `cp_size` holds, ascending.
std::vector<int64_t> ContextParallelPositions(int64_t length, int cp_rank,
                                              int cp_size);

struct ContextParallelBatch {
  // This rank's tokens: same rows and sample_index as the full batch, each
  // row's tokens in sample order, right-padded to the longest row of any cp
  // rank (so every rank's blocks have one shape); lengths count them.
  PackedBatch local;
  // positions[b, t]: the sample position of local token t (padding: the
  // sample's length); keys: every cp rank's tokens, rank by rank.
  AttentionLayout layout;
};

ContextParallelBatch SplitForContextParallel(const PackedBatch& batch,
                                             int cp_rank, int cp_size);

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_CONTEXT_PARALLEL_H_
