// LlamaModel: the decoder CausalLm of the Llama-derived families — HF Llama
// semantics (RMSNorm, GQA attention with rotate-half RoPE and rope_scaling,
// SwiGLU MLP, optional tied embeddings) over named LibTorch tensors, with
// the features its ModelFamily (model_family.h) switches on: q/k/v/o and MLP
// biases (Llama, Qwen2), per-head q/k RMSNorms (Qwen3), sliding-window
// attention (Mistral, Qwen2), and with config.num_local_experts > 0 the
// mixture-of-experts block of moe_block.h as every layer's MLP (Mixtral).
//
// Parameters are held under their HF names so checkpoints move between tally
// and the PyTorch ecosystem unchanged; LlamaShardingPlan says how each is
// split (Megatron layout: q, k, v, gate, up column-parallel, o and down
// row-parallel with their biases alike (o and down biases replicated, added
// after the tp reduction), embedding and lm_head vocab-parallel, norms and
// the router replicated over tp (q/k norms act on tp-local heads, so their
// gradients are summed over tp); every non-expert parameter dim-0 sharded over
// dp_shard; stacked experts Shard(0) over ep). Samples are batched one per
// row: positions restart at 0 per sample and no token attends across
// samples or to padding. Under context parallelism a row holds only this
// rank's tokens of its sample (see context_parallel.h); the AttentionLayout
// gives their positions in the sample.
//
// Only model_families.cc and tests include this header; everything else
// talks to CausalLm.
//
//   TALLY_ASSIGN_OR_RETURN(auto model, tally::LlamaModel::Create(
//       tally::LlamaConfig::EmbeddedDefault(), tally::DType::kFloat32, 7));
//   torch::Tensor logprobs = model->TargetLogprobs(
//       inputs, targets, tally::AttentionLayout::RightPadded(lengths, seq));
#ifndef TALLY_RUNTIME_MODEL_LLAMA_MODEL_H_
#define TALLY_RUNTIME_MODEL_LLAMA_MODEL_H_

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/model_family.h"
#include "runtime/model/causal_lm.h"
#include "runtime/parallel/sharding_plan.h"

namespace tally {

// INVALID_ARGUMENT naming the config field that tp does not divide.
absl::Status ValidateTensorParallel(const LlamaConfig& config, int tp);
// INVALID_ARGUMENT naming config.num_hidden_layers when there are fewer
// layers than pipeline stages.
absl::Status ValidatePipelineParallel(const LlamaConfig& config, int pp);

// How the Llama family's parameters split over the mesh.
ShardingPlan LlamaShardingPlan(const LlamaConfig& config);

// Whether a model of `dtype` on a mesh of `tp` ranks, on `device`, keeps its
// tensor-parallel partial sums in float32
// (LlamaModel::TensorParallelInFloat32): a low-precision dtype, tp > 1, the
// CPU, and a build with the bfloat16 -> float32 matmul
// (kernels/onednn_matmul.h; a PyTorch wheel's LibTorch has none and keeps
// LibTorch's linears).
bool TensorParallelInFloat32(int tp, DType dtype, const torch::Device& device);

class LlamaModel : public CausalLm {
 public:
  // Initializes from `seed`: normal(0, 0.02) matrices, ones for norms,
  // identical for a given (config, dtype, seed) whatever the sharding: every
  // rank draws the full tensors and keeps its shard. Under pp only the
  // stage's parameters are kept (a tied embedding is held by the first and
  // last stage, counted by the norm on the first).
  // With adapters.lora, every projection it targets carries LoRA factors
  // (lora.h), applied at the projection seam.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Create(
      const LlamaConfig& config, DType dtype, uint64_t seed,
      const ModelSharding& sharding = {}, const ModelAdapters& adapters = {});

  std::vector<std::string> ParameterNames() const override;
  std::vector<AuxiliaryLoss> auxiliary_losses() const override;
  std::vector<torch::Tensor> AuxiliaryTokenLosses(const StageIo& io) override;
  int64_t routed_experts() const override;
  int OwningStage(const std::string& name, int stages) const override;
  Parameter* SplitTiedEmbedding() override;
  NamedTensors ToHfTensors(NamedTensors tensors) const override;
  absl::StatusOr<NamedTensors> FromHfTensors(
      NamedTensors tensors) const override;
  torch::Tensor StageForward(const torch::Tensor& input,
                             const torch::Tensor& targets,
                             const AttentionLayout& layout,
                             StageIo* io) override;
  absl::StatusOr<torch::Tensor> ForwardWithCache(
      const torch::Tensor& input, const torch::Tensor& positions,
      const torch::Tensor& valid, KvCache& cache,
      const torch::Tensor& logits_at) override;

 private:
  LlamaModel(const LlamaConfig& config, DType dtype,
             const ModelSharding& sharding, const ModelAdapters& adapters,
             const ModelFamily& family);

  // A layer's parameters, by role; kLayerSlotNames holds their HF names
  // under "model.layers.<i>.".
  enum Slot {
    kQ,
    kK,
    kV,
    kO,
    kQBias,
    kKBias,
    kVBias,
    kOBias,
    kQNorm,
    kKNorm,
    kGate,
    kUp,
    kDown,
    kGateBias,
    kUpBias,
    kDownBias,
    kRouter,
    kW1,
    kW2,
    kW3,
    kInputNorm,
    kPostNorm,
    kNumSlots
  };
  // Whether this model's layers have the parameter of `slot`.
  bool HasSlot(Slot slot) const;
  // The full shape and initialization of a layer's `slot` parameter.
  ParameterSpec LayerSpec(Slot slot) const;

  // The HF parameters of the whole model in initialization order, marking
  // those this stage holds.
  std::vector<ParameterSpec> ParameterSpecs() const;
  // Resolves the indices the forward pass uses from InitializeParameters'.
  void IndexParameters(const std::vector<ParameterSpec>& specs,
                       const std::vector<int>& spec_indices);

  // The tp-local weight in the compute dtype: the parameter itself, or its
  // dp_shard shards gathered (differentiably: the backward reduce-scatters),
  // or under ZeRO stages 1 and 2 its kept gathered copy
  // (runtime/parallel/zero.h). Its gradient reaches the parameter (a
  // mixed-precision master: float32) with every sum over ranks run in the
  // parameter's dtype, over `tp_sum` too when given. An undefined tensor for
  // index -1.
  torch::Tensor Weight(int index, Communicator* tp_sum = nullptr);
  // A tp-replicated weight read inside the tp region (qk norms, LoRA
  // factors whole over tp): Weight with its partial gradients summed over
  // tp, in the parameter's dtype (Megatron's f on the master's side of the
  // cast, so a bfloat16 model never rounds that sum).
  torch::Tensor ReplicatedWeightInTensorParallel(int index);
  // The projection seam: every x W^T (+ b) of a block and the unembedding
  // go through here, with the LoRA term of the projection `index` when it
  // has one.
  torch::Tensor Project(const torch::Tensor& x, int index, int bias = -1);
  // A LoRA factor, ReplicatedWeightInTensorParallel when it is whole on
  // every tp rank (so its partial gradients sum over tp).
  torch::Tensor LoraFactor(int index);
  // Megatron's f and g: enter / leave a tensor-parallel region. With
  // TensorParallelInFloat32 the region's input is widened to float32 and its
  // output is the float32 sum rounded once to the compute dtype.
  torch::Tensor EnterTensorParallel(const torch::Tensor& x);
  torch::Tensor LeaveTensorParallel(const torch::Tensor& x);
  // Whether the tp linears keep their partial sums over tp in float32
  // (ColumnParallelLinear / RowParallelLinear,
  // runtime/parallel/parallel_ops.h): a low-precision compute dtype on a tp
  // mesh, on the CPU (CUDA keeps LibTorch's linears), in a build with the
  // oneDNN matmul (the free function above).
  bool TensorParallelInFloat32() const;
  // A row-parallel projection (with its LoRA term) reduced over tp, then
  // its bias.
  torch::Tensor ProjectRowParallel(const torch::Tensor& x, int index, int bias);
  torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w) const;
  // What a layer's attention masks by: the materialized mask [B, 1, T, K]
  // (true: hidden), or, for the blocked path (mask undefined), the layout
  // and the layer's sliding window that each block's mask is built from.
  // When decoding, the cache whose keys and values precede the new tokens'
  // (the layout's keys are then the cache's slots).
  struct AttentionMask {
    torch::Tensor mask;
    AttentionLayout layout;
    int64_t window = 0;
    KvCache* cache = nullptr;
  };
  torch::Tensor Attention(int layer, const torch::Tensor& h,
                          const torch::Tensor& cos, const torch::Tensor& sin,
                          const AttentionMask& mask);
  // softmax(q kᵀ / √d) v over the visible keys, [B, heads, T, d].
  torch::Tensor AttendHeads(const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v,
                            const AttentionMask& mask) const;
  // The attention masks of this stage's layers by sliding window (0: none):
  // [B, 1, T, K], true where a query must not see a key.
  std::map<int64_t, torch::Tensor> AttentionMasks(
      const AttentionLayout& layout) const;
  // The layer's MLP on h [B, T, H]: dense SwiGLU or the MoE block.
  torch::Tensor Mlp(int layer, const torch::Tensor& h, int64_t ep_rows,
                    StageIo* io);
  // One decoder layer (this stage's `layer`) on the residual stream x:
  // attention then MLP, each behind its RMSNorm and added back.
  torch::Tensor DecoderLayer(int layer, torch::Tensor x,
                             const torch::Tensor& cos, const torch::Tensor& sin,
                             const AttentionMask& mask, int64_t ep_rows,
                             StageIo* io);
  // This stage's decoder layers on x [B, T, H] at the layout's positions;
  // with `cache`, each layer's keys and values join it (no recomputation).
  torch::Tensor RunLayers(torch::Tensor x, const AttentionLayout& layout,
                          StageIo* io, KvCache* cache);
  // The first vocabulary row of this tp rank: rows [VocabStart(),
  // VocabStart() + V / tp) of the embedding and the head live here.
  int64_t VocabStart() const;
  // Embedding (first stage) or received hidden states.
  torch::Tensor Embed(const torch::Tensor& input);
  // The last stage's head: the logits [B, T, V / tp] in float32 at least ...
  torch::Tensor Logits(const torch::Tensor& x);
  // ... and the target log-probabilities.
  torch::Tensor TargetLogprobsFromHidden(const torch::Tensor& x,
                                         const torch::Tensor& targets);

  const ModelFamily& family_;
  const ModelFeatures features_;
  // Indices into parameters_ (resolved once, so the forward pass does no
  // string lookups); -1 where this stage does not hold the parameter or the
  // model has none, and layers_ holds this stage's layers only.
  struct LayerIndex {
    int slot[kNumSlots];
  };
  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  // By a base weight's index: its LoRA factors' indices (-1: none).
  struct LoraIndex {
    int a = -1, b = -1;
  };
  std::vector<LoraIndex> lora_;
  std::vector<LayerIndex> layers_;
  // The global index of layers_[0] (its layer number in the whole model).
  int64_t first_layer_ = 0;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_LLAMA_MODEL_H_
