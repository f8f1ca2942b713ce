// KvCache: the keys and values of a batch of sequences being decoded, so
// that each decoding step runs the model over the new tokens only
// (CausalLm::ForwardWithCache) instead of over the whole sequence again.
//
// Every layer keeps its keys (after RoPE and the q/k norms) and values
// [B, kv_heads, K, d] in the compute dtype, before the GQA repeat, with one
// key position and validity per row and slot [B, K]: the rows share the slot
// count K, and a slot a row does not use (the padding of a shorter prompt in
// a right-padded prefill) is an invalid key that no query reads. A forward
// over new tokens extends every row by the same number of slots; the new
// queries see the cached keys and each other under the usual rule
// (AttentionLayout: valid, at or before the query's position, within a
// sliding window), so the results equal a full forward over the whole
// sequence. Storage (keys, values, positions and validity) is reserved up
// front for `capacity` slots and doubles when a forward needs more: a step
// writes its slots in place, it never concatenates. Finished sequences leave
// with KeepRows.
//
//   tally::KvCache cache(config.num_hidden_layers, /*capacity=*/prompt + 64);
//   TALLY_ASSIGN_OR_RETURN(torch::Tensor logits, model.ForwardWithCache(
//       prompts, positions, valid, cache, /*logits_at=*/last));  // prefill
//   TALLY_ASSIGN_OR_RETURN(logits, model.ForwardWithCache(
//       next.unsqueeze(1), lengths.unsqueeze(1), all_valid, cache,
//       /*logits_at=*/torch::Tensor()));
//   cache.KeepRows(unfinished);
#ifndef TALLY_RUNTIME_MODEL_KV_CACHE_H_
#define TALLY_RUNTIME_MODEL_KV_CACHE_H_

#include <torch/torch.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "runtime/model/attention_layout.h"

namespace tally {

class KvCache {
 public:
  // An empty cache for a model of `num_layers` layers, reserving `capacity`
  // slots per row at the first forward.
  KvCache(int64_t num_layers, int64_t capacity);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // Rows (0 before the first forward) and slots per row.
  int64_t batch() const;
  int64_t length() const { return length_; }
  // Bytes of key and value storage held (the reserved capacity).
  int64_t bytes() const;

  // Begins a forward over new tokens [B, T] at `positions` (int64) of which
  // `valid` (bool) are real, both [B, T]: appends their slots and returns
  // the forward's AttentionLayout, its keys the cached slots followed by the
  // new ones. B must be the cache's batch once it has one.
  AttentionLayout Extend(const torch::Tensor& positions,
                         const torch::Tensor& valid);
  // In that forward, layer `layer`'s keys and values of the new tokens
  // [B, kv_heads, T, d]: stores them and returns the layer's keys and values
  // of every slot [B, kv_heads, K, d] (views of the cache's storage, valid
  // until the next call).
  std::pair<torch::Tensor, torch::Tensor> Append(int64_t layer,
                                                 const torch::Tensor& k,
                                                 const torch::Tensor& v);
  // Keeps the rows `rows` (int64 [B'], indices in the current batch) in
  // that order: finished sequences leave the batch.
  void KeepRows(const torch::Tensor& rows);

 private:
  struct Layer {
    torch::Tensor keys, values;  // [B, kv_heads, capacity, d]
  };
  std::vector<Layer> layers_;
  int64_t capacity_;
  // [B, capacity]: each slot's position in its sequence and whether it is
  // a key (the first K slots used), grown with the keys and values.
  torch::Tensor key_positions_, key_valid_;
  int64_t length_ = 0;   // K
  int64_t pending_ = 0;  // the slots the forward under way appends
};

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_KV_CACHE_H_
