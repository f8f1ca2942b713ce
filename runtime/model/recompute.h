// Activation checkpointing: a block whose activations are not kept from
// forward to backward but computed again in backward (the reentrant form of
// PyTorch's torch.utils.checkpoint). Memory for a decoder layer's
// activations drops to its input; the price is the layer's forward twice.
//
// The forward runs `block` without autograd and keeps only its input;
// backward runs `block` again on that input with autograd and
// back-propagates the output's gradient through it, which accumulates the
// gradients of the parameters `block` reads (their gradient hooks fire then)
// and returns the input's. Results are bitwise those of running `block`
// directly, as long as `block` computes the same values twice (no
// randomness) and issues the same collectives, in the same order, on every
// rank of its groups (all ranks recompute in the same backward order).
//
//   auto layer = [&](const torch::Tensor& h) { return DecoderLayer(i, h); };
//   x = recompute ? tally::RecomputeInBackward(layer, x) : layer(x);
#ifndef TALLY_RUNTIME_MODEL_RECOMPUTE_H_
#define TALLY_RUNTIME_MODEL_RECOMPUTE_H_

#include <torch/torch.h>

#include <functional>

namespace tally {

using TensorBlock = std::function<torch::Tensor(const torch::Tensor&)>;

// `block`(x) with its activations recomputed in backward. `block` is kept
// (with what it captures) until the backward has run or the graph is freed:
// capture tensors by value.
torch::Tensor RecomputeInBackward(TensorBlock block, const torch::Tensor& x);

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_RECOMPUTE_H_
