// LlamaModel: HF Llama semantics (RMSNorm, GQA attention with rotate-half
// RoPE, SwiGLU MLP, optional tied embeddings) over named LibTorch tensors.
//
// Parameters are held under their HF names so checkpoints move between tally
// and the PyTorch ecosystem unchanged; each carries its Placements so the
// gradient norm and the optimizer work on local shards whatever the mesh.
// Samples are batched with right padding: positions restart at 0 per sample
// and no token attends across samples or to padding.
//
//   TALLY_ASSIGN_OR_RETURN(auto model, tally::LlamaModel::Create(
//       tally::LlamaConfig::EmbeddedDefault(), tally::DType::kFloat32, 7));
//   torch::Tensor logprobs = model->TargetLogprobs(inputs, targets, lengths);
#ifndef TALLY_RUNTIME_LLAMA_MODEL_H_
#define TALLY_RUNTIME_LLAMA_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "runtime/llama_config.h"
#include "runtime/placement.h"
#include "runtime/types.h"

namespace tally {

struct Parameter {
  std::string name;      // HF name, e.g. "model.layers.0.mlp.up_proj.weight"
  torch::Tensor tensor;  // this rank's local shard; requires_grad
  Placements placements;
  bool is_expert = false;
};

torch::ScalarType ToScalarType(DType dtype);

class LlamaModel {
 public:
  // Initializes from `seed`: normal(0, 0.02) matrices, ones for norms,
  // identical for a given (config, dtype, seed).
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Create(
      const LlamaConfig& config, DType dtype, uint64_t seed);

  const LlamaConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }
  torch::ScalarType scalar_type() const { return ToScalarType(dtype_); }

  std::vector<Parameter>& parameters() { return parameters_; }
  const std::vector<Parameter>& parameters() const { return parameters_; }
  // nullptr when absent.
  Parameter* Find(const std::string& name);
  uint64_t NumParameters() const;

  // log p(targets[b, t] | inputs[b, 0..t]) for a right-padded batch.
  // inputs/targets: [B, T] int64 (ignored targets already replaced by any
  // in-range id); lengths[b] <= T is sample b's real length. Returns [B, T]
  // in the model dtype; padded positions hold values that must be masked.
  torch::Tensor TargetLogprobs(const torch::Tensor& inputs,
                               const torch::Tensor& targets,
                               const std::vector<int64_t>& lengths);

 private:
  LlamaModel(const LlamaConfig& config, DType dtype)
      : config_(config), dtype_(dtype) {}

  torch::Tensor& Weight(int index) { return parameters_[index].tensor; }
  torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w) const;
  torch::Tensor Attention(int layer, const torch::Tensor& h,
                          const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& mask);

  LlamaConfig config_;
  DType dtype_;
  std::vector<Parameter> parameters_;
  // Indices into parameters_ (resolved once, so the forward pass does no
  // string lookups).
  struct LayerIndex {
    int q, k, v, o, gate, up, down, input_norm, post_norm;
  };
  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  std::vector<LayerIndex> layers_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_LLAMA_MODEL_H_
