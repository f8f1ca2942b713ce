#include "runtime/model/kv_cache.h"

#include <algorithm>
#include <vector>

namespace tally {
namespace {

// `buffer` (slots along `dim`) with room for at least `slots` slots, its
// first `used` kept: itself, or a larger copy shaped like `like` (at least
// double, at least `capacity`) when it is too small.
torch::Tensor Reserve(const torch::Tensor& buffer, const torch::Tensor& like,
                      int64_t dim, int64_t used, int64_t slots,
                      int64_t capacity) {
  if (buffer.defined() && buffer.size(dim) >= slots) return buffer;
  const int64_t grown =
      std::max({slots, capacity, buffer.defined() ? 2 * buffer.size(dim) : 0});
  std::vector<int64_t> shape = like.sizes().vec();
  shape[dim] = grown;
  torch::Tensor larger = torch::empty(shape, like.options());
  if (used > 0) larger.narrow(dim, 0, used).copy_(buffer.narrow(dim, 0, used));
  return larger;
}

}  // namespace

KvCache::KvCache(int64_t num_layers, int64_t capacity)
    : layers_(num_layers), capacity_(capacity) {}

int64_t KvCache::batch() const {
  return key_positions_.defined() ? key_positions_.size(0) : 0;
}

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (const Layer& layer : layers_) {
    for (const torch::Tensor& t : {layer.keys, layer.values}) {
      if (t.defined()) total += t.numel() * t.element_size();
    }
  }
  return total;
}

AttentionLayout KvCache::Extend(const torch::Tensor& positions,
                                const torch::Tensor& valid) {
  TORCH_CHECK(positions.dim() == 2 && valid.sizes() == positions.sizes(),
              "positions and valid must both be [B, T]");
  TORCH_CHECK(batch() == 0 || positions.size(0) == batch(), "a batch of ",
              positions.size(0), " rows for a cache of ", batch());
  const int64_t used = length_;
  pending_ = positions.size(1);
  length_ += pending_;
  key_positions_ =
      Reserve(key_positions_, positions, 1, used, length_, capacity_);
  key_valid_ =
      Reserve(key_valid_, valid.to(torch::kBool), 1, used, length_, capacity_);
  key_positions_.narrow(1, used, pending_).copy_(positions);
  key_valid_.narrow(1, used, pending_).copy_(valid);
  return AttentionLayout{positions, key_positions_.narrow(1, 0, length_),
                         key_valid_.narrow(1, 0, length_)};
}

std::pair<torch::Tensor, torch::Tensor> KvCache::Append(
    int64_t layer, const torch::Tensor& k, const torch::Tensor& v) {
  Layer& cached = layers_.at(layer);
  const int64_t used = length_ - pending_;
  cached.keys = Reserve(cached.keys, k, 2, used, length_, capacity_);
  cached.values = Reserve(cached.values, v, 2, used, length_, capacity_);
  cached.keys.narrow(2, used, pending_).copy_(k);
  cached.values.narrow(2, used, pending_).copy_(v);
  return {cached.keys.narrow(2, 0, length_),
          cached.values.narrow(2, 0, length_)};
}

void KvCache::KeepRows(const torch::Tensor& rows) {
  TORCH_CHECK(batch() > 0, "KeepRows before the first forward");
  const torch::Tensor index = rows.to(key_positions_.device(), torch::kInt64);
  key_positions_ = key_positions_.index_select(0, index);
  key_valid_ = key_valid_.index_select(0, index);
  for (Layer& layer : layers_) {
    if (!layer.keys.defined()) continue;
    layer.keys = layer.keys.index_select(0, index);
    layer.values = layer.values.index_select(0, index);
  }
}

}  // namespace tally
