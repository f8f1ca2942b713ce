// Rotary position embeddings as transformers defines them: the inverse
// frequencies of ROPE_INIT_FUNCTIONS for config.rope_theta and
// config.rope_scaling ("" / default, "linear", "llama3") and the cos / sin
// tables HF's rotate-half form multiplies queries and keys by. Tables are
// computed in float64 and rounded to the model dtype (HF computes them in
// float32), so a float64 model's RoPE is exact.
//
//   auto [cos, sin] = tally::RotaryTables(config, layout.positions,
//                                         torch::kFloat32);
//   q = q * cos + RotateHalf(q) * sin;
#ifndef TALLY_RUNTIME_MODEL_ROPE_H_
#define TALLY_RUNTIME_MODEL_ROPE_H_

#include <torch/torch.h>

#include <utility>

#include "runtime/config/llama_config.h"

namespace tally {

// [HeadDim() / 2] float64: 1 / theta^(2i/d), rescaled by rope_scaling.
torch::Tensor RopeInverseFrequencies(const LlamaConfig& config);

// cos and sin [B, 1, T, d] of the angles position * inv_freq (each half of
// head_dim repeated) at `positions` [B, T], in `dtype`.
std::pair<torch::Tensor, torch::Tensor> RotaryTables(
    const LlamaConfig& config, const torch::Tensor& positions,
    torch::ScalarType dtype);

// HF's rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the last
// dim.
torch::Tensor RotateHalf(const torch::Tensor& x);

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_ROPE_H_
