#include "runtime/llama_model.h"

#include <cmath>

#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace tally {

torch::ScalarType ToScalarType(DType dtype) {
  return dtype == DType::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Create(
    const LlamaConfig& config, DType dtype, uint64_t seed) {
  TALLY_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<LlamaModel> model(new LlamaModel(config, dtype));
  TALLY_RETURN_IF_ERROR(CatchTorch("model init", [&] {
    torch::NoGradGuard no_grad;
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto options = torch::TensorOptions().dtype(ToScalarType(dtype));
    const int64_t h = config.hidden_size, d = config.head_dim();
    auto add = [&](std::string name, std::vector<int64_t> shape,
                   bool is_norm) -> int {
      torch::Tensor t = is_norm ? torch::ones(shape, options)
                                : torch::empty(shape, options);
      if (!is_norm) t.normal_(0.0, 0.02, generator);
      t.set_requires_grad(true);
      model->parameters_.push_back({std::move(name), t, Placements(), false});
      return static_cast<int>(model->parameters_.size()) - 1;
    };
    model->embed_ = add("model.embed_tokens.weight", {config.vocab_size, h},
                        false);
    for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      LayerIndex layer;
      layer.q = add(p + "self_attn.q_proj.weight",
                    {config.num_attention_heads * d, h}, false);
      layer.k = add(p + "self_attn.k_proj.weight",
                    {config.num_key_value_heads * d, h}, false);
      layer.v = add(p + "self_attn.v_proj.weight",
                    {config.num_key_value_heads * d, h}, false);
      layer.o = add(p + "self_attn.o_proj.weight",
                    {h, config.num_attention_heads * d}, false);
      layer.gate = add(p + "mlp.gate_proj.weight",
                       {config.intermediate_size, h}, false);
      layer.up = add(p + "mlp.up_proj.weight", {config.intermediate_size, h},
                     false);
      layer.down = add(p + "mlp.down_proj.weight",
                       {h, config.intermediate_size}, false);
      layer.input_norm = add(p + "input_layernorm.weight", {h}, true);
      layer.post_norm = add(p + "post_attention_layernorm.weight", {h}, true);
      model->layers_.push_back(layer);
    }
    model->final_norm_ = add("model.norm.weight", {h}, true);
    model->lm_head_ = config.tie_word_embeddings
                          ? model->embed_
                          : add("lm_head.weight", {config.vocab_size, h}, false);
  }));
  return model;
}

Parameter* LlamaModel::Find(const std::string& name) {
  for (Parameter& p : parameters_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

uint64_t LlamaModel::NumParameters() const {
  uint64_t n = 0;
  for (const Parameter& p : parameters_) n += p.tensor.numel();
  return n;
}

torch::Tensor LlamaModel::RmsNorm(const torch::Tensor& x,
                                  const torch::Tensor& w) const {
  torch::Tensor variance = x.pow(2).mean(-1, /*keepdim=*/true);
  return w * (x * torch::rsqrt(variance + config_.rms_norm_eps));
}

namespace {

// HF's rotate_half: (x1, x2) -> (-x2, x1) over the two halves of head_dim.
torch::Tensor RotateHalf(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

torch::Tensor LlamaModel::Attention(int layer, const torch::Tensor& h,
                                    const torch::Tensor& cos,
                                    const torch::Tensor& sin,
                                    const torch::Tensor& mask) {
  const LayerIndex& idx = layers_[layer];
  const int64_t batch = h.size(0), seq = h.size(1), d = config_.head_dim();
  // Local head counts come from the (possibly tp-sharded) weights.
  const int64_t heads = Weight(idx.q).size(0) / d;
  const int64_t kv_heads = Weight(idx.k).size(0) / d;
  auto split_heads = [&](const torch::Tensor& t, int64_t n) {
    return t.view({batch, seq, n, d}).transpose(1, 2);
  };
  torch::Tensor q = split_heads(torch::linear(h, Weight(idx.q)), heads);
  torch::Tensor k = split_heads(torch::linear(h, Weight(idx.k)), kv_heads);
  torch::Tensor v = split_heads(torch::linear(h, Weight(idx.v)), kv_heads);
  q = q * cos + RotateHalf(q) * sin;
  k = k * cos + RotateHalf(k) * sin;
  if (heads != kv_heads) {
    // Query head j reads kv head j / (heads / kv_heads), as HF's repeat_kv.
    k = k.repeat_interleave(heads / kv_heads, /*dim=*/1);
    v = v.repeat_interleave(heads / kv_heads, /*dim=*/1);
  }
  torch::Tensor scores =
      torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
  scores = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
  torch::Tensor out = torch::matmul(torch::softmax(scores, -1), v);
  out = out.transpose(1, 2).reshape({batch, seq, heads * d});
  return torch::linear(out, Weight(idx.o));
}

torch::Tensor LlamaModel::TargetLogprobs(const torch::Tensor& inputs,
                                         const torch::Tensor& targets,
                                         const std::vector<int64_t>& lengths) {
  const int64_t batch = inputs.size(0), seq = inputs.size(1);
  const int64_t d = config_.head_dim();
  const auto options = torch::TensorOptions().dtype(scalar_type());

  // Rotary tables in the model dtype: inv_freq = 1 / theta^(2i/d).
  torch::Tensor inv_freq =
      1.0 / torch::pow(config_.rope_theta,
                       torch::arange(0, d, 2, options) / static_cast<double>(d));
  torch::Tensor freqs =
      torch::outer(torch::arange(seq, options), inv_freq);  // [T, d/2]
  torch::Tensor emb = torch::cat({freqs, freqs}, -1);       // [T, d]
  torch::Tensor cos = emb.cos(), sin = emb.sin();

  // masked[b, 0, i, j]: key j is in the future of i or is padding of b.
  torch::Tensor causal =
      torch::ones({seq, seq}, torch::kBool).triu(/*diagonal=*/1);
  torch::Tensor key_is_pad =
      torch::arange(seq).unsqueeze(0) >=
      torch::tensor(lengths, torch::kInt64).unsqueeze(1);  // [B, T]
  torch::Tensor mask =
      causal.view({1, 1, seq, seq}) | key_is_pad.view({batch, 1, 1, seq});

  torch::Tensor x = torch::embedding(Weight(embed_), inputs);
  for (size_t layer = 0; layer < layers_.size(); ++layer) {
    const LayerIndex& idx = layers_[layer];
    x = x + Attention(static_cast<int>(layer),
                      RmsNorm(x, Weight(idx.input_norm)), cos, sin, mask);
    torch::Tensor h = RmsNorm(x, Weight(idx.post_norm));
    x = x + torch::linear(torch::silu(torch::linear(h, Weight(idx.gate))) *
                              torch::linear(h, Weight(idx.up)),
                          Weight(idx.down));
  }
  torch::Tensor logits =
      torch::linear(RmsNorm(x, Weight(final_norm_)), Weight(lm_head_));
  return torch::log_softmax(logits, -1)
      .gather(-1, targets.unsqueeze(-1))
      .squeeze(-1);
}

}  // namespace tally
