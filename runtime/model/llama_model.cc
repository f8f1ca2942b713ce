#include "runtime/model/llama_model.h"

#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "kernels/chunked_xent.h"
#include "kernels/onednn_matmul.h"
#include "runtime/config/families/registry.h"
#include "runtime/model/blocked_attention.h"
#include "runtime/model/kv_cache.h"
#include "runtime/model/lora.h"
#include "runtime/model/moe_block.h"
#include "runtime/model/recompute.h"
#include "runtime/model/rope.h"
#include "runtime/parallel/parallel_ops.h"
#include "runtime/parallel/pipeline.h"
#include "runtime/parallel/zero.h"

namespace tally {

absl::Status ValidateTensorParallel(const LlamaConfig& config, int tp) {
  for (auto [field, value] :
       {std::pair<const char*, int64_t>{"num_attention_heads",
                                        config.num_attention_heads},
        {"num_key_value_heads", config.num_key_value_heads},
        {"intermediate_size", config.intermediate_size},
        {"vocab_size", config.vocab_size}}) {
    if (value % tp != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.", field, " (", value,
                       ") is not divisible by tp (", tp, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePipelineParallel(const LlamaConfig& config, int pp) {
  if (pp > config.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.num_hidden_layers (", config.num_hidden_layers,
        ") is smaller than pp (", pp, "): every stage needs a layer"));
  }
  return absl::OkStatus();
}

ShardingPlan LlamaShardingPlan(const LlamaConfig& config) {
  using S = ParallelStyle;
  ShardingPlan plan;
  plan.rules = {
      {"model.embed_tokens.weight", S::kColumnwise,
       /*shared_across_stages=*/config.tie_word_embeddings},
      {"model.layers.*.self_attn.q_proj.weight", S::kColumnwise},
      {"model.layers.*.self_attn.k_proj.weight", S::kColumnwise},
      {"model.layers.*.self_attn.v_proj.weight", S::kColumnwise},
      {"model.layers.*.self_attn.o_proj.weight", S::kRowwise},
      {"model.layers.*.self_attn.q_proj.bias", S::kColumnwise},
      {"model.layers.*.self_attn.k_proj.bias", S::kColumnwise},
      {"model.layers.*.self_attn.v_proj.bias", S::kColumnwise},
      {"model.layers.*.self_attn.o_proj.bias", S::kReplicate},
      {"model.layers.*.self_attn.q_norm.weight", S::kReplicate},
      {"model.layers.*.self_attn.k_norm.weight", S::kReplicate},
      {"model.layers.*.mlp.gate_proj.weight", S::kColumnwise},
      {"model.layers.*.mlp.up_proj.weight", S::kColumnwise},
      {"model.layers.*.mlp.down_proj.weight", S::kRowwise},
      {"model.layers.*.mlp.gate_proj.bias", S::kColumnwise},
      {"model.layers.*.mlp.up_proj.bias", S::kColumnwise},
      {"model.layers.*.mlp.down_proj.bias", S::kReplicate},
      {"model.layers.*.block_sparse_moe.gate.weight", S::kReplicate},
      {"model.layers.*.block_sparse_moe.experts.w1.weight", S::kExpert},
      {"model.layers.*.block_sparse_moe.experts.w2.weight", S::kExpert},
      {"model.layers.*.block_sparse_moe.experts.w3.weight", S::kExpert},
      {"model.layers.*.input_layernorm.weight", S::kReplicate},
      {"model.layers.*.post_attention_layernorm.weight", S::kReplicate},
      {"model.norm.weight", S::kReplicate},
      {"lm_head.weight", S::kColumnwise},
  };
  AddLoraRules(plan);
  return plan;
}

bool TensorParallelInFloat32(int tp, DType dtype, const torch::Device& device) {
  const torch::ScalarType compute = ComputeScalarType(dtype);
  return tp > 1 && AtLeastFloat32(compute) != compute && device.is_cpu() &&
         HasBf16ToFloat32Matmul();
}

namespace {

// HF names of a layer's parameters under "model.layers.<i>.", by
// LlamaModel::Slot.
constexpr const char* kLayerSlotNames[] = {
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.gate_proj.bias",
    "mlp.up_proj.bias",
    "mlp.down_proj.bias",
    "block_sparse_moe.gate.weight",
    "block_sparse_moe.experts.w1.weight",
    "block_sparse_moe.experts.w2.weight",
    "block_sparse_moe.experts.w3.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
};

}  // namespace

LlamaModel::LlamaModel(const LlamaConfig& config, DType dtype,
                       const ModelSharding& sharding,
                       const ModelAdapters& adapters, const ModelFamily& family)
    : CausalLm(config, dtype, sharding, adapters),
      family_(family),
      features_(family.Features(config)) {}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Create(
    const LlamaConfig& config, DType dtype, uint64_t seed,
    const ModelSharding& sharding, const ModelAdapters& adapters) {
  TALLY_RETURN_IF_ERROR(config.Validate());
  if (adapters.lora.enabled()) {
    TALLY_RETURN_IF_ERROR(ValidateLoraConfig(adapters.lora));
    TALLY_RETURN_IF_ERROR(ValidateLoraForModel(config, adapters.lora));
  }
  TALLY_RETURN_IF_ERROR(ValidateTensorParallel(config, sharding.tp_size()));
  TALLY_RETURN_IF_ERROR(ValidateExpertParallel(config, sharding.ep_size()));
  TALLY_RETURN_IF_ERROR(ValidatePipelineParallel(config, sharding.pp_stages));
  TALLY_ASSIGN_OR_RETURN(const ModelFamily* family,
                         FindModelFamily(config.ResolvedModelType()));
  std::unique_ptr<LlamaModel> model(
      new LlamaModel(config, dtype, sharding, adapters, *family));
  TALLY_RETURN_IF_ERROR(CatchTorch("model init", [&]() -> absl::Status {
    const std::vector<ParameterSpec> specs = model->ParameterSpecs();
    TALLY_ASSIGN_OR_RETURN(
        std::vector<int> indices,
        model->InitializeParameters(specs, LlamaShardingPlan(config), seed));
    model->IndexParameters(specs, indices);
    return absl::OkStatus();
  }));
  return model;
}

bool LlamaModel::HasSlot(Slot slot) const {
  switch (slot) {
    case kQBias:
    case kKBias:
    case kVBias:
      return features_.qkv_bias;
    case kOBias:
      return features_.o_bias;
    case kQNorm:
    case kKNorm:
      return features_.qk_norm;
    case kGate:
    case kUp:
    case kDown:
      return !config_.is_moe();
    case kGateBias:
    case kUpBias:
    case kDownBias:
      return !config_.is_moe() && features_.mlp_bias;
    case kRouter:
    case kW1:
    case kW2:
    case kW3:
      return config_.is_moe();
    default:
      return true;
  }
}

ParameterSpec LlamaModel::LayerSpec(Slot slot) const {
  const LlamaConfig& c = config_;
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  const int64_t q = c.num_attention_heads * c.HeadDim();
  const int64_t kv = c.num_key_value_heads * c.HeadDim();
  const int64_t experts = c.num_local_experts;
  using I = ParameterInit;
  switch (slot) {
    case kQ:
      return {"", {q, h}};
    case kK:
    case kV:
      return {"", {kv, h}};
    case kO:
      return {"", {h, q}};
    case kQBias:
      return {"", {q}, I::kZeros};
    case kKBias:
    case kVBias:
      return {"", {kv}, I::kZeros};
    case kQNorm:
    case kKNorm:
      return {"", {c.HeadDim()}, I::kOnes};
    case kGate:
    case kUp:
      return {"", {inter, h}};
    case kDown:
      return {"", {h, inter}};
    case kGateBias:
    case kUpBias:
      return {"", {inter}, I::kZeros};
    case kOBias:
    case kDownBias:
      return {"", {h}, I::kZeros};
    case kRouter:
      return {"", {experts, h}};
    case kW1:
    case kW3:
      return {"", {experts, inter, h}};
    case kW2:
      return {"", {experts, h, inter}};
    default:
      return {"", {h}, I::kOnes};  // the layer norms
  }
}

std::vector<ParameterSpec> LlamaModel::ParameterSpecs() const {
  const LlamaConfig& c = config_;
  const int64_t h = c.hidden_size;
  const bool first = first_stage(), last = last_stage();
  const LayerRange held_layers =
      StageLayers(c.num_hidden_layers, sharding_.pp_stage, sharding_.pp_stages);
  std::vector<ParameterSpec> specs;
  specs.push_back({"model.embed_tokens.weight",
                   {c.vocab_size, h},
                   ParameterInit::kNormal,
                   first || (last && c.tie_word_embeddings)});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    for (int slot = 0; slot < kNumSlots; ++slot) {
      if (!HasSlot(static_cast<Slot>(slot))) continue;
      ParameterSpec spec = LayerSpec(static_cast<Slot>(slot));
      spec.name = absl::StrCat("model.layers.", i, ".", kLayerSlotNames[slot]);
      spec.held = i >= held_layers.begin && i < held_layers.end;
      specs.push_back(std::move(spec));
    }
  }
  specs.push_back({"model.norm.weight", {h}, ParameterInit::kOnes, last});
  if (!c.tie_word_embeddings) {
    specs.push_back(
        {"lm_head.weight", {c.vocab_size, h}, ParameterInit::kNormal, last});
  }
  for (ParameterSpec& spec : LoraParameterSpecs(c, lora(), held_layers, last)) {
    specs.push_back(std::move(spec));
  }
  return specs;
}

void LlamaModel::IndexParameters(const std::vector<ParameterSpec>& specs,
                                 const std::vector<int>& spec_indices) {
  const LayerRange held = StageLayers(config_.num_hidden_layers,
                                      sharding_.pp_stage, sharding_.pp_stages);
  first_layer_ = held.begin;
  layers_.assign(held.end - held.begin, LayerIndex{});
  for (LayerIndex& layer : layers_) std::fill_n(layer.slot, kNumSlots, -1);
  const std::string layer_prefix = "model.layers.";
  std::map<std::string, int> index_of;
  for (size_t s = 0; s < specs.size(); ++s) {
    const int index = spec_indices[s];
    if (index < 0) continue;
    const std::string& name = specs[s].name;
    index_of[name] = index;
    if (IsLoraParameter(name)) continue;  // indexed below, by base weight
    if (name == "model.embed_tokens.weight") {
      if (first_stage()) embed_ = index;
      if (config_.tie_word_embeddings && last_stage()) lm_head_ = index;
    } else if (name == "model.norm.weight") {
      final_norm_ = index;
    } else if (name == "lm_head.weight") {
      lm_head_ = index;
    } else {
      // "model.layers.<i>.<slot name>"
      const size_t dot = name.find('.', layer_prefix.size());
      int64_t layer = 0;
      const bool parsed = absl::SimpleAtoi(
          name.substr(layer_prefix.size(), dot - layer_prefix.size()), &layer);
      TORCH_CHECK(parsed, "unexpected parameter ", name);
      const std::string slot_name = name.substr(dot + 1);
      for (int slot = 0; slot < kNumSlots; ++slot) {
        if (slot_name == kLayerSlotNames[slot]) {
          layers_[layer - first_layer_].slot[slot] = index;
        }
      }
    }
  }
  lora_.assign(parameters_.size(), LoraIndex{});
  for (const auto& [name, index] : index_of) {
    if (!IsLoraParameter(name)) continue;
    // "<module>.lora_A.weight": the module's weight, or a tied lm_head's
    // embedding.
    const std::string module = name.substr(0, name.rfind(".lora_"));
    const int base =
        module == "lm_head" ? lm_head_ : index_of.at(module + ".weight");
    (name.find(".lora_A.") != std::string::npos ? lora_[base].a
                                                : lora_[base].b) = index;
  }
}

std::vector<std::string> LlamaModel::ParameterNames() const {
  std::vector<std::string> names;
  for (ParameterSpec& spec : ParameterSpecs()) {
    names.push_back(std::move(spec.name));
  }
  return names;
}

std::vector<AuxiliaryLoss> LlamaModel::auxiliary_losses() const {
  const double coefficient = config_.load_balancing_coefficient();
  if (!config_.is_moe() || coefficient == 0.0) return {};
  return {{kRouterLoadBalancing, coefficient,
           LoadBalancingChannels(config_.num_local_experts)}};
}

std::vector<torch::Tensor> LlamaModel::AuxiliaryTokenLosses(const StageIo& io) {
  if (auxiliary_losses().empty()) return {};
  return {LoadBalancingLoss(io.auxiliary.at(0), io.real_tokens,
                            config_.num_hidden_layers, sharding_.cp)};
}

int64_t LlamaModel::routed_experts() const { return config_.num_local_experts; }

int LlamaModel::OwningStage(const std::string& name, int stages) const {
  const int64_t num_layers = config_.num_hidden_layers;
  if (name == "model.embed_tokens.weight") return 0;
  if (name == "model.norm.weight" || absl::StartsWith(name, "lm_head.")) {
    return stages - 1;
  }
  constexpr char kPrefix[] = "model.layers.";
  if (!absl::StartsWith(name, kPrefix)) return -1;
  const size_t begin = sizeof(kPrefix) - 1;
  const size_t end = name.find('.', begin);
  int64_t layer;
  if (end == std::string::npos ||
      !absl::SimpleAtoi(name.substr(begin, end - begin), &layer) || layer < 0 ||
      layer >= num_layers) {
    return -1;
  }
  for (int s = 0; s < stages; ++s) {
    if (layer < StageLayers(num_layers, s, stages).end) return s;
  }
  return -1;
}

Parameter* LlamaModel::SplitTiedEmbedding() {
  if (!config_.tie_word_embeddings || sharding_.pp_stages == 1) return nullptr;
  Parameter* copy = first_stage()  ? &parameters_[embed_]
                    : last_stage() ? &parameters_[lm_head_]
                                   : nullptr;
  // A frozen embedding has no gradients to sum.
  return copy != nullptr && copy->trainable ? copy : nullptr;
}

NamedTensors LlamaModel::ToHfTensors(NamedTensors tensors) const {
  return config_.is_moe() ? ExpertWeightsToHf(std::move(tensors)) : tensors;
}

absl::StatusOr<NamedTensors> LlamaModel::FromHfTensors(
    NamedTensors tensors) const {
  if (!config_.is_moe()) return tensors;
  return ExpertWeightsFromHf(std::move(tensors));
}

torch::Tensor LlamaModel::Weight(int index, Communicator* tp_sum) {
  if (index < 0) return torch::Tensor();
  const Parameter& p = parameters_[index];
  // ZeRO stages 1 and 2: kept gathered between steps.
  if (p.gathered != nullptr) {
    return GatheredWeight(p, *sharding_.dp_shard, tp_sum);
  }
  // The tp sum on the master's side of the cast: it adds float32 gradients.
  const torch::Tensor master =
      tp_sum == nullptr ? p.tensor
                        : CopyToTensorParallelRegion(p.tensor, *tp_sum);
  // Mixed precision: the float32 master's bfloat16 copy, made once until
  // the master changes (compute_weights.h), or before a dp_shard gather
  // (which then moves half the bytes); the gradient goes back to the master
  // in float32, reduce-scattered in float32.
  if (!p.placements.at(MeshDim::kDpShard).is_shard()) {
    if (compute_type() == master.scalar_type()) return master;
    return UseComputeCopy(master, ComputeCopy(index));
  }
  return GatherShardedParameter(master, p.tp_local_shape[0],
                                *sharding_.dp_shard, compute_type());
}

torch::Tensor LlamaModel::ReplicatedWeightInTensorParallel(int index) {
  return Weight(index, sharding_.tp_size() == 1 ? nullptr : sharding_.tp);
}

bool LlamaModel::TensorParallelInFloat32() const {
  return tally::TensorParallelInFloat32(sharding_.tp_size(), dtype(), device());
}

torch::Tensor LlamaModel::EnterTensorParallel(const torch::Tensor& x) {
  if (sharding_.tp_size() == 1) return x;
  return CopyToTensorParallelRegion(
      TensorParallelInFloat32() ? x.to(torch::kFloat32) : x, *sharding_.tp);
}

torch::Tensor LlamaModel::LeaveTensorParallel(const torch::Tensor& x) {
  if (sharding_.tp_size() == 1) return x;
  torch::Tensor sum = ReduceFromTensorParallelRegion(x, *sharding_.tp);
  return TensorParallelInFloat32() ? sum.to(compute_type()) : sum;
}

torch::Tensor LlamaModel::Project(const torch::Tensor& x, int index, int bias) {
  const bool adapted = lora_[index].a >= 0;
  if (TensorParallelInFloat32() &&
      parameters_[index].placements.at(MeshDim::kTp).shard_dim() == 0) {
    torch::Tensor out =
        ColumnParallelLinear(x, Weight(index), compute_type(), Weight(bias));
    if (!adapted) return out;
    // A is whole on every rank; its gradient is summed over tp inside the
    // delta, in float32, so it is not summed again.
    return out + ColumnParallelLoraDelta(x, Weight(lora_[index].a),
                                         Weight(lora_[index].b),
                                         lora().scaling(), *sharding_.tp);
  }
  torch::Tensor out = torch::linear(x, Weight(index), Weight(bias));
  if (!adapted) return out;
  return out + LoraDelta(x, LoraFactor(lora_[index].a),
                         LoraFactor(lora_[index].b), lora().scaling());
}

torch::Tensor LlamaModel::LoraFactor(int index) {
  const bool whole_over_tp =
      !parameters_[index].placements.at(MeshDim::kTp).is_shard();
  return whole_over_tp ? ReplicatedWeightInTensorParallel(index)
                       : Weight(index);
}

torch::Tensor LlamaModel::ProjectRowParallel(const torch::Tensor& x, int index,
                                             int bias) {
  torch::Tensor out;
  if (!TensorParallelInFloat32()) {
    out = LeaveTensorParallel(Project(x, index));
  } else {
    out = LeaveTensorParallel(RowParallelLinear(x, Weight(index)));
    if (lora_[index].a >= 0) {
      // B is whole on every rank and its gradient complete: not summed.
      out = out + RowParallelLoraDelta(x, Weight(lora_[index].a),
                                       Weight(lora_[index].b), lora().scaling(),
                                       *sharding_.tp);
    }
  }
  return bias < 0 ? out : out + Weight(bias);
}

torch::Tensor LlamaModel::RmsNorm(const torch::Tensor& x,
                                  const torch::Tensor& w) const {
  // As HF: in float32 at least, the normalized values rounded back to the
  // input's dtype before the weight (no-ops for float32 and float64).
  const torch::Tensor wide = x.to(AtLeastFloat32(x.scalar_type()));
  torch::Tensor variance = wide.pow(2).mean(-1, /*keepdim=*/true);
  return w * (wide * torch::rsqrt(variance + config_.rms_norm_eps))
                 .to(x.scalar_type());
}

torch::Tensor LlamaModel::AttendHeads(const torch::Tensor& q,
                                      const torch::Tensor& k,
                                      const torch::Tensor& v,
                                      const AttentionMask& mask) const {
  if (!mask.mask.defined()) {
    return BlockedAttention(q, k, v, mask.layout, mask.window,
                            attention().block_keys);
  }
  // k and v may hold fewer (kv) heads than q (the blocked path above wants
  // them repeated): query head j reads kv head j / groups (HF's repeat_kv)
  // with no repeated copy, the queries of a kv head's group of heads being
  // the rows of one matmul, [B, kv_heads, groups x T, d] (a view while T is
  // 1, as in a decoding step).
  const int64_t batch = q.size(0), heads = q.size(1), seq = q.size(2),
                d = q.size(3), kv_heads = k.size(1);
  const int64_t groups = heads / kv_heads;
  torch::Tensor scores =
      torch::matmul(q.reshape({batch, kv_heads, groups * seq, d}),
                    k.transpose(-2, -1)) /
      std::sqrt(static_cast<double>(d));
  scores = scores.view({batch, kv_heads, groups, seq, -1})
               .masked_fill(mask.mask.unsqueeze(2),
                            -std::numeric_limits<double>::infinity());
  // The softmax in float32 at least, as HF's eager attention.
  const torch::Tensor probs =
      torch::softmax(scores, -1, AtLeastFloat32(scores.scalar_type()))
          .to(v.scalar_type())
          .view({batch, kv_heads, groups * seq, -1});
  return torch::matmul(probs, v).view({batch, heads, seq, d});
}

torch::Tensor LlamaModel::Attention(int layer, const torch::Tensor& h,
                                    const torch::Tensor& cos,
                                    const torch::Tensor& sin,
                                    const AttentionMask& mask) {
  const int* slot = layers_[layer].slot;
  const int64_t batch = h.size(0), seq = h.size(1), d = config_.HeadDim();
  // Local head counts: a tp rank holds a contiguous block of query heads and
  // the kv heads they read, so GQA's grouping is the same locally.
  const int64_t heads = parameters_[slot[kQ]].tp_local_shape[0] / d;
  const int64_t kv_heads = parameters_[slot[kK]].tp_local_shape[0] / d;
  auto split_heads = [&](const torch::Tensor& t, int64_t n) {
    return t.view({batch, seq, n, d}).transpose(1, 2);
  };
  torch::Tensor q = split_heads(Project(h, slot[kQ], slot[kQBias]), heads);
  torch::Tensor k = split_heads(Project(h, slot[kK], slot[kKBias]), kv_heads);
  torch::Tensor v = split_heads(Project(h, slot[kV], slot[kVBias]), kv_heads);
  if (features_.qk_norm) {
    // Replicated weights acting on tp-local heads: entering the tp region
    // sums their gradients over tp.
    q = RmsNorm(q, ReplicatedWeightInTensorParallel(slot[kQNorm]));
    k = RmsNorm(k, ReplicatedWeightInTensorParallel(slot[kKNorm]));
  }
  q = q * cos + RotateHalf(q) * sin;
  k = k * cos + RotateHalf(k) * sin;
  if (sharding_.cp_size() > 1 && mask.cache == nullptr) {
    // Before the GQA repeat, so the gather moves kv_heads, not heads. (A
    // decoding row holds a whole sequence: nothing to gather.)
    k = GatherSequenceBlocks(k, *sharding_.cp);
    v = GatherSequenceBlocks(v, *sharding_.cp);
  }
  if (mask.cache != nullptr) {
    std::tie(k, v) = mask.cache->Append(first_layer_ + layer, k, v);
  }
  // A decoding forward's materialized attention reads the cache's kv heads
  // as they are (AttendHeads); the blocked path and training repeat them.
  const bool grouped = mask.cache != nullptr && mask.mask.defined();
  if (heads != kv_heads && !grouped) {
    // Query head j reads kv head j / (heads / kv_heads), as HF's repeat_kv.
    k = k.repeat_interleave(heads / kv_heads, /*dim=*/1);
    v = v.repeat_interleave(heads / kv_heads, /*dim=*/1);
  }
  torch::Tensor out = AttendHeads(q, k, v, mask)
                          .transpose(1, 2)
                          .reshape({batch, seq, heads * d});
  return ProjectRowParallel(out, slot[kO], slot[kOBias]);
}

torch::Tensor LlamaModel::Mlp(int layer, const torch::Tensor& h,
                              int64_t ep_rows, StageIo* io) {
  const int* slot = layers_[layer].slot;
  if (config_.is_moe()) {
    MoeOptions options;
    options.num_experts = config_.num_local_experts;
    options.experts_per_token = config_.num_experts_per_tok;
    options.layer = first_layer_ + layer;
    options.num_layers = config_.num_hidden_layers;
    const MoeWeights weights{Weight(slot[kRouter]), Weight(slot[kW1]),
                             Weight(slot[kW2]), Weight(slot[kW3])};
    return SparseMoeForward(options, h, weights, ep_rows, sharding_, io);
  }
  torch::Tensor x = EnterTensorParallel(h);
  torch::Tensor gated = torch::silu(Project(x, slot[kGate], slot[kGateBias])) *
                        Project(x, slot[kUp], slot[kUpBias]);
  return ProjectRowParallel(gated, slot[kDown], slot[kDownBias]);
}

int64_t LlamaModel::VocabStart() const {
  return sharding_.tp_rank() * (config_.vocab_size / sharding_.tp_size());
}

torch::Tensor LlamaModel::Embed(const torch::Tensor& input) {
  if (!first_stage()) return input;
  return sharding_.tp_size() == 1
             ? torch::embedding(Weight(embed_), input)
             : VocabParallelEmbedding(input, Weight(embed_), VocabStart(),
                                      *sharding_.tp);
}

torch::Tensor LlamaModel::Logits(const torch::Tensor& x) {
  // In float32 at least (HF upcasts logits for the loss).
  return Project(EnterTensorParallel(RmsNorm(x, Weight(final_norm_))), lm_head_)
      .to(AtLeastFloat32(compute_type()));
}

torch::Tensor LlamaModel::TargetLogprobsFromHidden(
    const torch::Tensor& x, const torch::Tensor& targets) {
  // Over chunks of tokens, without the whole call's float32 logits; the
  // vocab-parallel head (its logsumexp spans the tp ranks) and a LoRA-adapted
  // head take the composed path.
  if (sharding_.tp_size() == 1 && lora_[lm_head_].a < 0) {
    return kernels::ChunkedTargetLogprobs(RmsNorm(x, Weight(final_norm_)),
                                          Weight(lm_head_), targets);
  }
  const torch::Tensor logits = Logits(x);
  if (sharding_.tp_size() > 1) {
    return VocabParallelTargetLogprobs(logits, targets, VocabStart(),
                                       *sharding_.tp);
  }
  return torch::log_softmax(logits, -1)
      .gather(-1, targets.unsqueeze(-1))
      .squeeze(-1);
}

std::map<int64_t, torch::Tensor> LlamaModel::AttentionMasks(
    const AttentionLayout& layout) const {
  const int64_t keys = layout.key_positions.size(1);
  std::map<int64_t, torch::Tensor> masks;
  for (int64_t layer = first_layer_;
       layer < first_layer_ + static_cast<int64_t>(layers_.size()); ++layer) {
    const int64_t window = family_.AttentionWindow(config_, layer);
    if (masks.count(window) > 0) continue;
    // A real query always sees itself; a padding query that would see
    // nothing within the window keeps its causal keys, so its (masked)
    // output stays finite.
    torch::Tensor seen = layout.VisibleKeys(window, 0, keys);
    if (window > 0) {
      const torch::Tensor causal = layout.VisibleKeys(0, 0, keys);
      seen = seen | (causal & ~seen.any(-1, /*keepdim=*/true));
    }
    masks[window] = (~seen).unsqueeze(1);  // [B, 1, T, K]: masked out
  }
  return masks;
}

torch::Tensor LlamaModel::DecoderLayer(int layer, torch::Tensor x,
                                       const torch::Tensor& cos,
                                       const torch::Tensor& sin,
                                       const AttentionMask& mask,
                                       int64_t ep_rows, StageIo* io) {
  const int* slot = layers_[layer].slot;
  x = x + Attention(layer,
                    EnterTensorParallel(RmsNorm(x, Weight(slot[kInputNorm]))),
                    cos, sin, mask);
  return x + Mlp(layer, RmsNorm(x, Weight(slot[kPostNorm])), ep_rows, io);
}

torch::Tensor LlamaModel::StageForward(const torch::Tensor& input,
                                       const torch::Tensor& targets,
                                       const AttentionLayout& layout,
                                       StageIo* io) {
  // [B, T]: the token ids, or the leading dims of the hidden states.
  const int64_t batch = input.size(0), seq = input.size(1);
  if (!config_.is_moe()) io = nullptr;
  if (io != nullptr) {
    TORCH_CHECK(io->real_tokens.sizes() == c10::IntArrayRef({batch, seq}),
                "io.real_tokens must be shaped [B, T] like input");
    io->expert_tokens = torch::zeros(
        {config_.num_hidden_layers, config_.num_local_experts},
        torch::TensorOptions(torch::kFloat64).device(input.device()));
  }
  torch::Tensor x = RunLayers(Embed(input), layout, io, /*cache=*/nullptr);
  if (!last_stage()) return x;
  return TargetLogprobsFromHidden(x, targets);
}

torch::Tensor LlamaModel::RunLayers(torch::Tensor x,
                                    const AttentionLayout& layout, StageIo* io,
                                    KvCache* cache) {
  const int64_t tokens = x.size(0) * x.size(1);
  // Rotary tables at each token's position in its sample.
  const auto [cos, sin] =
      RotaryTables(config_, layout.positions, compute_type());
  // The materialized masks, unless attention goes by blocks of keys.
  const bool blocked = attention().Blocked(layout.key_positions.size(1));
  const std::map<int64_t, torch::Tensor> masks =
      blocked ? std::map<int64_t, torch::Tensor>() : AttentionMasks(layout);
  // The expert dispatch pads every ep rank's tokens to the largest count.
  const int64_t ep_rows =
      config_.is_moe() ? ExpertDispatchRows(tokens, sharding_) : tokens;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const int layer = static_cast<int>(i);
    const int64_t window =
        family_.AttentionWindow(config_, first_layer_ + layer);
    AttentionMask mask{blocked ? torch::Tensor() : masks.at(window), layout,
                       window, cache};
    // Tensors by value: a recomputed layer runs again in backward.
    TensorBlock block = [this, layer, cos = cos, sin = sin,
                         mask = std::move(mask), ep_rows,
                         io](const torch::Tensor& h) {
      return DecoderLayer(layer, h, cos, sin, mask, ep_rows, io);
    };
    x = recompute_layers() && cache == nullptr
            ? RecomputeInBackward(std::move(block), x)
            : block(x);
  }
  return x;
}

absl::StatusOr<torch::Tensor> LlamaModel::ForwardWithCache(
    const torch::Tensor& input, const torch::Tensor& positions,
    const torch::Tensor& valid, KvCache& cache,
    const torch::Tensor& logits_at) {
  const int64_t input_dims = first_stage() ? 2 : 3;
  if (input.dim() != input_dims ||
      (!first_stage() && input.size(2) != config_.hidden_size) ||
      positions.dim() != 2 || positions.sizes() != input.sizes().slice(0, 2) ||
      valid.sizes() != positions.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input must be ", first_stage() ? "token ids [B, T]" : "hidden states",
        first_stage() ? "" : absl::StrCat(" [B, T, ", config_.hidden_size, "]"),
        " and positions and valid [B, T] alike"));
  }
  if (logits_at.defined() &&
      (logits_at.dim() != 1 || logits_at.size(0) != input.size(0) ||
       logits_at.scalar_type() != torch::kInt64 ||
       (logits_at.numel() > 0 &&
        (logits_at.min().item<int64_t>() < 0 ||
         logits_at.max().item<int64_t>() >= input.size(1))))) {
    return absl::InvalidArgumentError(
        absl::StrCat("logits_at must be one int64 position in [0, ",
                     input.size(1), ") per row of ", input.size(0)));
  }
  if (cache.num_layers() != config_.num_hidden_layers ||
      (cache.batch() != 0 && cache.batch() != input.size(0))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a KV cache of ", cache.num_layers(), " layers and ", cache.batch(),
        " rows for ", input.size(0), " rows of a model of ",
        config_.num_hidden_layers, " layers"));
  }
  return CatchTorch("decoding forward", [&]() -> absl::StatusOr<torch::Tensor> {
    torch::NoGradGuard no_grad;
    const torch::Device here = device();
    const AttentionLayout layout =
        cache.Extend(positions.to(here, torch::kInt64), valid.to(here));
    torch::Tensor x =
        RunLayers(Embed(input.to(here)), layout, /*io=*/nullptr, &cache);
    if (!last_stage()) return x;
    if (logits_at.defined()) {
      x = x.gather(1, logits_at.to(here)
                          .view({x.size(0), 1, 1})
                          .expand({x.size(0), 1, x.size(2)}));
    }
    torch::Tensor logits = Logits(x);
    if (sharding_.tp_size() == 1) return logits;
    return GatherVocabShards(logits, *sharding_.tp);
  });
}

}  // namespace tally
