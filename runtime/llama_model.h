// LlamaModel: HF Llama semantics (RMSNorm, GQA attention with rotate-half
// RoPE, SwiGLU MLP, optional tied embeddings) over named LibTorch tensors;
// with config.num_local_experts > 0, HF Mixtral semantics: each layer's MLP
// is a block_sparse_moe (a softmax router, top-k renormalized over the chosen
// k, SwiGLU experts w2(silu(w1 x) * w3 x)).
//
// The experts of a layer are held as three stacked parameters
// "model.layers.{i}.block_sparse_moe.experts.{w1,w2,w3}.weight" [E, ...],
// Shard(0) over ep (is_expert), so every rank holds the same parameter list;
// ExpertWeightsToHf / ExpertWeightsFromHf map them to and from HF's
// per-expert names "...experts.{e}.w1.weight" at the checkpoint boundary.
//
// Parameters are held under their HF names so checkpoints move between tally
// and the PyTorch ecosystem unchanged; each carries its Placements so the
// gradient norm and the optimizer work on local shards whatever the mesh.
// Samples are batched one per row: positions restart at 0 per sample and no
// token attends across samples or to padding. Under context parallelism a row
// holds only this rank's tokens of its sample (see context_parallel.h); the
// AttentionLayout gives their positions in the sample.
//
//   TALLY_ASSIGN_OR_RETURN(auto model, tally::LlamaModel::Create(
//       tally::LlamaConfig::EmbeddedDefault(), tally::DType::kFloat32, 7));
//   torch::Tensor logprobs = model->TargetLogprobs(
//       inputs, targets, tally::AttentionLayout::RightPadded(lengths, seq));
#ifndef TALLY_RUNTIME_LLAMA_MODEL_H_
#define TALLY_RUNTIME_LLAMA_MODEL_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/attention_layout.h"
#include "runtime/communicator.h"
#include "runtime/llama_config.h"
#include "runtime/parameter.h"
#include "runtime/placement.h"
#include "runtime/safetensors.h"
#include "runtime/types.h"

namespace tally {

// What the routers of a MoE model saw in one TargetLogprobs call.
struct RouterStats {
  // In: [B, T] bool, the tokens that count (not padding). Required.
  torch::Tensor real_tokens;
  // Out: [layers, E] float64, the real tokens routed to each expert of each
  // layer (a token counts for each of its top-k experts).
  torch::Tensor expert_tokens;
  // Out: [B, T] model dtype, differentiable: the per-token load-balancing
  // term averaged over layers, E * sum over the token's top-k experts of
  // their router probability (k for a uniform router).
  torch::Tensor aux;
};

// The groups a model is split over. A null or single-rank group means the
// dimension is not split; the default is the single-device model.
struct ModelSharding {
  Communicator* tp = nullptr;        // Megatron tensor parallelism
  Communicator* dp_shard = nullptr;  // ZeRO-3 / FSDP parameter sharding
  // Context parallelism: the ranks splitting each sample's tokens, whose
  // keys and values attention gathers. Parameters are replicated over it.
  Communicator* cp = nullptr;
  // Expert parallelism: the ranks splitting the experts of every MoE layer,
  // each computing its experts for the tokens of all of them.
  Communicator* ep = nullptr;
  // Pipeline parallelism: this rank builds and runs stage `pp_stage` of
  // `pp_stages` (see pipeline.h). The engine moves activations between
  // stages; the model itself never talks to another stage.
  int pp_stage = 0;
  int pp_stages = 1;

  int ep_size() const { return ep ? ep->size() : 1; }
  int ep_rank() const { return ep ? ep->rank() : 0; }
  int tp_size() const { return tp ? tp->size() : 1; }
  int tp_rank() const { return tp ? tp->rank() : 0; }
  int dp_shard_size() const { return dp_shard ? dp_shard->size() : 1; }
  int dp_shard_rank() const { return dp_shard ? dp_shard->rank() : 0; }
  int cp_size() const { return cp ? cp->size() : 1; }
};

// INVALID_ARGUMENT naming the config field that tp does not divide.
absl::Status ValidateTensorParallel(const LlamaConfig& config, int tp);
// INVALID_ARGUMENT naming config.num_hidden_layers when there are fewer
// layers than pipeline stages.
absl::Status ValidatePipelineParallel(const LlamaConfig& config, int pp);

// INVALID_ARGUMENT when ep does not divide config.num_local_experts of a
// MoE config (a dense model ignores ep).
absl::Status ValidateExpertParallel(const LlamaConfig& config, int ep);

// The stacked expert parameter "....experts.w1.weight" [E, ...] a per-expert
// HF name "....experts.{e}.w1.weight" belongs to, and e; nullopt for any
// other name.
std::optional<std::pair<std::string, int64_t>> StackedExpertName(
    const std::string& hf_name);
// Replaces every stacked expert tensor of `tensors` by its E per-expert HF
// tensors (the order of the other tensors is kept).
NamedTensors ExpertWeightsToHf(NamedTensors tensors);
// The inverse: per-expert HF tensors stacked under the stacked name (experts
// in index order). INVALID_ARGUMENT when an expert index is missing,
// repeated, or the experts' shapes differ.
absl::StatusOr<NamedTensors> ExpertWeightsFromHf(NamedTensors tensors);

torch::ScalarType ToScalarType(DType dtype);

class LlamaModel {
 public:
  // Initializes from `seed`: normal(0, 0.02) matrices, ones for norms,
  // identical for a given (config, dtype, seed) whatever the sharding: every
  // rank draws the full tensors and keeps its shard. Megatron layout: q, k,
  // v, gate, up column-parallel (tp Shard(0)), o and down row-parallel
  // (Shard(1)), embedding and lm_head vocab-parallel (Shard(0)), norms
  // Replicate; every parameter dim-0 sharded over dp_shard. MoE: the router
  // is placed like a norm (replicated over tp, sharded over dp_shard); the
  // stacked experts are Shard(0) over ep and replicated over tp, dp_shard
  // (no ZeRO sharding) and dp_replicate. Under pp only the stage's
  // parameters are kept (placed Shard along pp, except a tied embedding:
  // Replicate, held by the first and last stage and counted by the norm on
  // the first).
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Create(
      const LlamaConfig& config, DType dtype, uint64_t seed,
      const ModelSharding& sharding = {});

  const LlamaConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }
  torch::ScalarType scalar_type() const { return ToScalarType(dtype_); }

  std::vector<Parameter>& parameters() { return parameters_; }
  const std::vector<Parameter>& parameters() const { return parameters_; }
  // nullptr when absent.
  Parameter* Find(const std::string& name);
  // Of this stage's parameters, unsharded (the whole model when pp = 1).
  uint64_t NumParameters() const;

  int pp_stage() const { return sharding_.pp_stage; }
  bool first_stage() const { return sharding_.pp_stage == 0; }
  bool last_stage() const {
    return sharding_.pp_stage == sharding_.pp_stages - 1;
  }
  // The tied embedding when the first and last stage each hold a copy whose
  // gradients must be summed before a step; nullptr otherwise.
  Parameter* SplitTiedEmbedding();

  // This rank's shard of `full` (shaped like parameter `p`'s full_shape):
  // what Create keeps of a freshly drawn tensor and what loading keeps of a
  // checkpoint's.
  torch::Tensor LocalShard(const Parameter& p, const torch::Tensor& full) const;
  // The inverse: the full tensor from every rank's `local` (shaped like
  // p.tensor). Collective over the model's tp and dp_shard groups (ep for
  // experts).
  absl::StatusOr<torch::Tensor> GatherFull(const Parameter& p,
                                           const torch::Tensor& local);
  bool sharded() const {
    return sharding_.tp_size() > 1 || sharding_.dp_shard_size() > 1 ||
           sharding_.ep_size() > 1;
  }

  // log p(targets[b, t] | the tokens of b's sample at or before t).
  // inputs/targets: [B, T] int64 (ignored targets already replaced by any
  // in-range id), laid out as `layout` says. Returns [B, T] in the model
  // dtype; padded positions hold finite values that must be masked. Under
  // cp, every rank of the cp group must call it with the same B and T; under
  // ep, every rank of the ep group calls it the same number of times (the
  // MoE layers' collectives pair up), with any B and T.
  // A MoE model fills `router_stats` when given. Requires a single-stage
  // model (pp = 1).
  torch::Tensor TargetLogprobs(const torch::Tensor& inputs,
                               const torch::Tensor& targets,
                               const AttentionLayout& layout,
                               RouterStats* router_stats = nullptr);
  // This rank's pipeline stage of TargetLogprobs. `input`: the token ids
  // [B, T] on the first stage, else the previous stage's hidden states.
  // Returns the target logprobs [B, T] on the last stage (`targets` is read
  // there only), else the hidden states [B, T, hidden_size] for the next
  // stage. A MoE stage fills the rows of its layers in
  // `router_stats->expert_tokens` and adds its layers' terms to
  // `router_stats->aux` (which carries the earlier stages' sum, or is
  // undefined on the first stage).
  torch::Tensor StageForward(const torch::Tensor& input,
                             const torch::Tensor& targets,
                             const AttentionLayout& layout,
                             RouterStats* router_stats = nullptr);

 private:
  LlamaModel(const LlamaConfig& config, DType dtype,
             const ModelSharding& sharding)
      : config_(config), dtype_(dtype), sharding_(sharding) {}

  // The tp-local weight: the parameter itself, or its dp_shard shards
  // gathered (differentiably: the backward reduce-scatters).
  torch::Tensor Weight(int index);
  // Megatron's f and g: enter / leave a tensor-parallel region.
  torch::Tensor EnterTensorParallel(const torch::Tensor& x);
  torch::Tensor LeaveTensorParallel(const torch::Tensor& x);
  torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w) const;
  torch::Tensor Attention(int layer, const torch::Tensor& h,
                          const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& mask);
  // The layer's MLP on h [B, T, H]: dense SwiGLU or block_sparse_moe.
  torch::Tensor Mlp(int layer, const torch::Tensor& h, int64_t ep_rows,
                    RouterStats* stats);
  // ep_rows: the most tokens any rank of the ep group has in this call.
  torch::Tensor SparseMoe(int layer, const torch::Tensor& h, int64_t ep_rows,
                          RouterStats* stats);

  LlamaConfig config_;
  DType dtype_;
  ModelSharding sharding_;
  std::vector<Parameter> parameters_;
  // Indices into parameters_ (resolved once, so the forward pass does no
  // string lookups); -1 where this stage does not hold the parameter, and
  // layers_ holds this stage's layers only.
  struct LayerIndex {
    int q, k, v, o, input_norm, post_norm;
    int gate = -1, up = -1, down = -1;           // dense MLP
    int router = -1, w1 = -1, w2 = -1, w3 = -1;  // block_sparse_moe
  };
  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  std::vector<LayerIndex> layers_;
  // The global index of layers_[0] (its layer number in the whole model).
  int64_t first_layer_ = 0;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_LLAMA_MODEL_H_
