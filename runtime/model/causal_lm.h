// CausalLm: what the runtime needs of a decoder-only language model, whatever
// its family. The engine, the pipeline schedule, checkpoints, the optimizer
// and the gradient norm talk to this interface and to the Parameters it
// holds; a family (Llama, with or without a mixture-of-experts MLP; Qwen,
// Mistral next) implements it in files of its own and is registered in
// model_families.cc. How parameters are split over the mesh is data — a
// ShardingPlan per family (sharding_plan.h) — not code in a constructor.
//
//   TALLY_ASSIGN_OR_RETURN(std::unique_ptr<tally::CausalLm> model,
//                          tally::CreateCausalLm(config,
//                          tally::DType::kFloat64,
//                                                /*seed=*/7, sharding));
//   tally::StageIo io;  // per-token auxiliary losses and routing counts
//   torch::Tensor logprobs = model->StageForward(inputs, targets, layout, &io);
#ifndef TALLY_RUNTIME_MODEL_CAUSAL_LM_H_
#define TALLY_RUNTIME_MODEL_CAUSAL_LM_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/lora_config.h"
#include "runtime/config/types.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/attention_layout.h"
#include "runtime/model/compute_weights.h"
#include "runtime/parallel/parameter.h"
#include "runtime/parallel/sharding_plan.h"

namespace tally {

// The dtype of a model's parameters and gradients (MasterDType's) ...
torch::ScalarType ToScalarType(DType dtype);
// ... and of its matmuls and activations: bfloat16 for a mixed-precision
// model, else the same.
torch::ScalarType ComputeScalarType(DType dtype);
// float32 for the reduced-precision types, else `type` itself: where
// softmaxes, norms and log-probabilities are computed.
torch::ScalarType AtLeastFloat32(torch::ScalarType type);

// A term a model adds to each token's training loss, weighted by
// `coefficient` (MoE load balancing). Its statistics travel with the hidden
// states as `channels` per-token values; on the last stage
// CausalLm::AuxiliaryTokenLosses turns them into a per-token term which,
// joining the token's loss, is weighted and normalized exactly like the
// token's cross-entropy.
struct AuxiliaryLoss {
  std::string name;  // e.g. "router_load_balancing"
  double coefficient = 0.0;
  int64_t channels = 1;
};

// What a stage's forward reads and adds besides its main input and output.
struct StageIo {
  // In: [B, T] bool, the tokens that count (not padding); required by a
  // model with routing statistics, ignored otherwise.
  torch::Tensor real_tokens;
  // In and out: one [B, T, channels] tensor per auxiliary_losses() entry,
  // in that order, accumulated over the layers so far. Empty on entry to the
  // first stage; each stage adds its layers' share.
  std::vector<torch::Tensor> auxiliary;
  // Out: [layers, E] float64, the real tokens routed to each expert of each
  // of this stage's layers (other layers' rows zero); undefined for a model
  // without routing.
  torch::Tensor expert_tokens;
};

class CausalLm;
class KvCache;  // kv_cache.h

// The LoRA adapters a model carries (runtime/model/lora.h) and the frozen base
// they adapt.
struct ModelAdapters {
  LoraConfig lora;  // rank 0: no adapters
  // A model of the same config, dtype and sharding whose (frozen) parameter
  // tensors the new model shares instead of drawing its own: one base in
  // memory for many adapters. It lives as long as any model sharing it.
  std::shared_ptr<const CausalLm> base;
  // Without a base, for an unsharded model only: the base's parameters as
  // frozen placeholders that hold no memory (every element reads 0) instead
  // of drawn tensors. What a writer of the adapter alone builds, so that
  // writing an adapter of a large base does not allocate the base.
  bool base_placeholders = false;
};

class CausalLm {
 public:
  virtual ~CausalLm() = default;

  const LlamaConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }
  torch::ScalarType scalar_type() const { return ToScalarType(dtype_); }
  torch::ScalarType compute_type() const { return ComputeScalarType(dtype_); }
  const ModelSharding& sharding() const { return sharding_; }

  std::vector<Parameter>& parameters() { return parameters_; }
  const std::vector<Parameter>& parameters() const { return parameters_; }
  // nullptr when absent.
  Parameter* Find(const std::string& name);
  const Parameter* Find(const std::string& name) const;
  // Freezes every parameter whose name matches `pattern` (a name where '*'
  // stands for a layer number, see NameMatches): it takes no gradient from
  // then on. Returns how many this stage holds. Freeze before the optimizer
  // is built, so no state is allocated for them.
  int Freeze(const std::string& pattern);
  // Freezes every parameter but the LoRA adapters' (all of a model without
  // adapters): what makes a model a base.
  void FreezeBase();
  // The model's LoRA adapters (rank 0: none) and the base it shares
  // parameters with (nullptr: its own).
  const LoraConfig& lora() const { return adapters_.lora; }
  const std::shared_ptr<const CausalLm>& base() const { return adapters_.base; }
  // Of this stage's parameters, unsharded (the whole model when pp = 1).
  uint64_t NumParameters() const;

  // Activation checkpointing: each decoder layer keeps only its input and
  // runs again in backward (recompute.h); same results, bitwise. Models
  // whose layers write StageIo (routing statistics) refuse it,
  // INVALID_ARGUMENT.
  absl::Status set_recompute_layers(bool recompute);
  // Places every parameter on `device`, keeping each tensor's identity (the
  // layers and a shared base's users see the move); those already there,
  // such as a shared base's, stay. Models are built and loaded on the host,
  // so the same seed draws the same weights on every device.
  absl::Status To(const torch::Device& device);
  torch::Device device() const;
  bool recompute_layers() const { return recompute_layers_; }
  // How attention is computed (runtime/model/blocked_attention.h); the results
  // do not depend on it beyond rounding.
  void set_attention(const AttentionOptions& options) { attention_ = options; }
  const AttentionOptions& attention() const { return attention_; }

  int pp_stage() const { return sharding_.pp_stage; }
  bool first_stage() const { return sharding_.pp_stage == 0; }
  bool last_stage() const {
    return sharding_.pp_stage == sharding_.pp_stages - 1;
  }
  bool sharded() const {
    return sharding_.tp_size() > 1 || sharding_.dp_shard_size() > 1 ||
           sharding_.ep_size() > 1;
  }

  // This rank's shard of `full` (shaped like p.full_shape) and the inverse
  // (collective over the groups p is split over); see sharding_plan.h.
  torch::Tensor LocalShard(const Parameter& p, const torch::Tensor& full) const;
  absl::StatusOr<torch::Tensor> GatherFull(const Parameter& p,
                                           const torch::Tensor& local);

  // Every parameter name of the whole model (all stages), in order.
  virtual std::vector<std::string> ParameterNames() const = 0;
  // The auxiliary losses StageIo::auxiliary carries, in order; empty for
  // most families.
  virtual std::vector<AuxiliaryLoss> auxiliary_losses() const = 0;
  // On the last stage, after StageForward: each auxiliary loss's per-token
  // term [B, T] (differentiable) from io's channels. Collective over cp.
  virtual std::vector<torch::Tensor> AuxiliaryTokenLosses(
      const StageIo& io) = 0;
  // The number of experts whose routing StageIo::expert_tokens counts (0:
  // no routing).
  virtual int64_t routed_experts() const = 0;

  // The stage of a `stages`-stage split of this family that owns (and
  // checkpoints) the HF parameter `name`; -1 for a name that is no parameter
  // of the family.
  virtual int OwningStage(const std::string& name, int stages) const = 0;
  // The tied embedding when the first and last stage each hold a copy whose
  // gradients must be summed before a step; nullptr otherwise.
  virtual Parameter* SplitTiedEmbedding() = 0;

  // Tensors under tally's parameter names to the HF checkpoint names and
  // back (e.g. stacked experts to per-expert tensors). INVALID_ARGUMENT
  // naming the tensor for a malformed checkpoint.
  virtual NamedTensors ToHfTensors(NamedTensors tensors) const = 0;
  virtual absl::StatusOr<NamedTensors> FromHfTensors(
      NamedTensors tensors) const = 0;

  // This rank's pipeline stage of the model. `input`: the token ids [B, T]
  // on the first stage, else the previous stage's hidden states. Returns
  // log p(targets[b, t] | the tokens of b's sample at or before t) [B, T] on
  // the last stage (`targets`, int64 [B, T] with ignored targets replaced by
  // any in-range id, is read there only), else the hidden states for the
  // next stage. Padded positions hold finite values that must be masked.
  // Under cp every rank of the cp group calls it with the same B and T;
  // under ep every rank of the ep group calls it the same number of times.
  virtual torch::Tensor StageForward(const torch::Tensor& input,
                                     const torch::Tensor& targets,
                                     const AttentionLayout& layout,
                                     StageIo* io) = 0;
  // The whole model's StageForward (requires pp = 1), for tests and tools.
  torch::Tensor TargetLogprobs(const torch::Tensor& inputs,
                               const torch::Tensor& targets,
                               const AttentionLayout& layout,
                               StageIo* io = nullptr);
  // Decoding (kv_cache.h): this rank's stage of the model, without
  // gradients, over new tokens at `positions` of which `valid` are real
  // (both [B, T]), their keys the cache's followed by their own. `input`:
  // the token ids [B, T] on the first stage, else the previous stage's
  // hidden states [B, T, H]. Appends the stage's layers' keys and values to
  // `cache` (a cache of the whole model's layers) and returns, on the last
  // stage, the logits [B, T, V] in float32 at least (the dtype
  // TargetLogprobs' log-softmax runs in), whole and bitwise alike on every
  // tp rank; on other stages the hidden states for the next one. On a mesh
  // it splits as the training forward does: tp shards the heads and so the
  // cache; dp_shard gathers the parameters and ep dispatches the tokens, so
  // every rank of those groups must call it the same number of times
  // (runtime/sample/mesh_decode.h keeps them in step). Under cp a row holds
  // a whole sequence: no keys are gathered over cp. UNIMPLEMENTED for a
  // family without a cache path; INVALID_ARGUMENT for shapes that do not
  // match each other, the stage or the cache. `logits_at` ([B] int64, or
  // undefined for every position) asks the last stage for the logits after
  // one position per row only: [B, 1, V] (a prefill needs each prompt's
  // last; the lm head over every position is most of its cost).
  virtual absl::StatusOr<torch::Tensor> ForwardWithCache(
      const torch::Tensor& input, const torch::Tensor& positions,
      const torch::Tensor& valid, KvCache& cache,
      const torch::Tensor& logits_at);

  // Mixed precision casts each float32 master to the compute dtype once and
  // every forward reuses that copy (compute_weights.h) until the master
  // changes: in-place LibTorch writes (and the Optimizer's kernels, which
  // bump the version) and new storage are noticed; any other writer calls
  // WeightsChanged after writing. BuiltModel calls it after each OptimStep
  // and LoadCheckpoint besides, To() after a move.
  void WeightsChanged() { compute_weights_.Invalidate(); }
  // The bytes of the compute-dtype copies this model's forwards read, its
  // shared base's included (0 for a float32 or float64 model, which uses its
  // weights as they are): every weight it holds whole over dp_shard once a
  // forward has run. dp_shard-sharded weights are gathered per pass (ZeRO-3)
  // or kept gathered in the compute dtype (ZeRO-1/2), not copied here.
  int64_t ComputeWeightBytes() const;

 protected:
  CausalLm(const LlamaConfig& config, DType dtype,
           const ModelSharding& sharding, ModelAdapters adapters)
      : config_(config),
        dtype_(dtype),
        sharding_(sharding),
        adapters_(std::move(adapters)) {}

  // Draws every parameter of `specs` in order from `seed` (normal(0, 0.02),
  // ones for norms), whatever the sharding, and keeps what the plan places
  // on this rank and stage. LoRA parameters are drawn from a generator of
  // their own, seeded by lora().seed (default: `seed`), so an adapter's
  // values do not depend on its base; with a base() the other parameters
  // are the base's tensors, shared and frozen, not drawn. Returns each
  // spec's index into parameters_ (-1 for a parameter this stage does not
  // hold). With adapters.base_placeholders the base's parameters are
  // placeholders instead, neither drawn nor allocated. INTERNAL when the
  // plan misses a parameter or the base one.
  absl::StatusOr<std::vector<int>> InitializeParameters(
      const std::vector<ParameterSpec>& specs, const ShardingPlan& plan,
      uint64_t seed);
  // A base parameter's placeholder (adapters.base_placeholders): frozen,
  // shaped like `spec`, one element of storage. Returns its index.
  absl::StatusOr<int> AddPlaceholder(const ParameterSpec& spec,
                                     const ShardingPlan& plan);

  LlamaConfig config_;
  DType dtype_;
  ModelSharding sharding_;
  std::vector<Parameter> parameters_;
  ModelAdapters adapters_;
  // The compute-dtype copy of parameters_[index] (held whole over
  // dp_shard), without autograd: kept by this model, or by its shared base
  // for a parameter of the base, so the adapters over one base share one
  // copy of it.
  torch::Tensor ComputeCopy(int index) const;

 private:
  // Freezes the parameters whose name `frozen` holds for; returns how many.
  int FreezeWhere(const std::function<bool(const std::string& name)>& frozen);

  bool recompute_layers_ = false;
  AttentionOptions attention_;
  // Of a parameter shared with base(): its index there; -1 for one of this
  // model's own.
  std::vector<int> base_index_;
  mutable ComputeWeights compute_weights_;
};

// The family `config` names (config.json's model_type), built and placed for
// `sharding`. INVALID_ARGUMENT naming the config field a family or the mesh
// cannot take.
// With `adapters`, the model carries LoRA adapters (over adapters.base when
// set); INVALID_ARGUMENT naming the lora field the model cannot take.
absl::StatusOr<std::unique_ptr<CausalLm>> CreateCausalLm(
    const LlamaConfig& config, DType dtype, uint64_t seed,
    const ModelSharding& sharding = {}, const ModelAdapters& adapters = {});

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_CAUSAL_LM_H_
