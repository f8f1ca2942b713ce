#include "runtime/llama_model.h"

#include <cmath>
#include <limits>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/moe_block.h"
#include "runtime/parallel_ops.h"
#include "runtime/pipeline.h"

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
      {"model.layers.*.mlp.gate_proj.weight", S::kColumnwise},
      {"model.layers.*.mlp.up_proj.weight", S::kColumnwise},
      {"model.layers.*.mlp.down_proj.weight", S::kRowwise},
      {"model.layers.*.block_sparse_moe.gate.weight", S::kReplicate},
      {"model.layers.*.block_sparse_moe.experts.w1.weight", S::kExpert},
      {"model.layers.*.block_sparse_moe.experts.w2.weight", S::kExpert},
      {"model.layers.*.block_sparse_moe.experts.w3.weight", S::kExpert},
      {"model.layers.*.input_layernorm.weight", S::kReplicate},
      {"model.layers.*.post_attention_layernorm.weight", S::kReplicate},
      {"model.norm.weight", S::kReplicate},
      {"lm_head.weight", S::kColumnwise},
  };
  return plan;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Create(
    const LlamaConfig& config, DType dtype, uint64_t seed,
    const ModelSharding& sharding) {
  TALLY_RETURN_IF_ERROR(config.Validate());
  TALLY_RETURN_IF_ERROR(ValidateTensorParallel(config, sharding.tp_size()));
  TALLY_RETURN_IF_ERROR(ValidateExpertParallel(config, sharding.ep_size()));
  TALLY_RETURN_IF_ERROR(ValidatePipelineParallel(config, sharding.pp_stages));
  std::unique_ptr<LlamaModel> model(new LlamaModel(config, dtype, sharding));
  TALLY_RETURN_IF_ERROR(CatchTorch("model init", [&]() -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(
        std::vector<int> indices,
        model->InitializeParameters(model->ParameterSpecs(),
                                    LlamaShardingPlan(config), seed));
    model->IndexParameters(indices);
    return absl::OkStatus();
  }));
  return model;
}

std::vector<ParameterSpec> LlamaModel::ParameterSpecs() const {
  const LlamaConfig& c = config_;
  const int64_t h = c.hidden_size, d = c.head_dim();
  const int64_t inter = c.intermediate_size, experts = c.num_local_experts;
  const bool first = first_stage(), last = last_stage();
  const LayerRange held_layers =
      StageLayers(c.num_hidden_layers, sharding_.pp_stage, sharding_.pp_stages);
  std::vector<ParameterSpec> specs;
  specs.push_back({"model.embed_tokens.weight",
                   {c.vocab_size, h},
                   false,
                   first || (last && c.tie_word_embeddings)});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    const bool held = i >= held_layers.begin && i < held_layers.end;
    auto add = [&](std::string name, std::vector<int64_t> shape,
                   bool ones = false) {
      specs.push_back({p + name, std::move(shape), ones, held});
    };
    add("self_attn.q_proj.weight", {c.num_attention_heads * d, h});
    add("self_attn.k_proj.weight", {c.num_key_value_heads * d, h});
    add("self_attn.v_proj.weight", {c.num_key_value_heads * d, h});
    add("self_attn.o_proj.weight", {h, c.num_attention_heads * d});
    if (c.is_moe()) {
      add("block_sparse_moe.gate.weight", {experts, h});
      add("block_sparse_moe.experts.w1.weight", {experts, inter, h});
      add("block_sparse_moe.experts.w2.weight", {experts, h, inter});
      add("block_sparse_moe.experts.w3.weight", {experts, inter, h});
    } else {
      add("mlp.gate_proj.weight", {inter, h});
      add("mlp.up_proj.weight", {inter, h});
      add("mlp.down_proj.weight", {h, inter});
    }
    add("input_layernorm.weight", {h}, /*ones=*/true);
    add("post_attention_layernorm.weight", {h}, /*ones=*/true);
  }
  specs.push_back({"model.norm.weight", {h}, true, last});
  if (!c.tie_word_embeddings) {
    specs.push_back({"lm_head.weight", {c.vocab_size, h}, false, last});
  }
  return specs;
}

void LlamaModel::IndexParameters(const std::vector<int>& spec_indices) {
  std::map<std::string, int> index;
  for (int i : spec_indices) {
    if (i >= 0) index[parameters_[i].name] = i;
  }
  auto find = [&](const std::string& name) {
    auto it = index.find(name);
    return it == index.end() ? -1 : it->second;
  };
  const int embedding = find("model.embed_tokens.weight");
  embed_ = first_stage() ? embedding : -1;
  final_norm_ = find("model.norm.weight");
  lm_head_ = config_.tie_word_embeddings ? (last_stage() ? embedding : -1)
                                         : find("lm_head.weight");
  const LayerRange held = StageLayers(config_.num_hidden_layers,
                                      sharding_.pp_stage, sharding_.pp_stages);
  first_layer_ = held.begin;
  for (int64_t i = held.begin; i < held.end; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    LayerIndex layer;
    layer.q = find(p + "self_attn.q_proj.weight");
    layer.k = find(p + "self_attn.k_proj.weight");
    layer.v = find(p + "self_attn.v_proj.weight");
    layer.o = find(p + "self_attn.o_proj.weight");
    layer.gate = find(p + "mlp.gate_proj.weight");
    layer.up = find(p + "mlp.up_proj.weight");
    layer.down = find(p + "mlp.down_proj.weight");
    layer.router = find(p + "block_sparse_moe.gate.weight");
    layer.w1 = find(p + "block_sparse_moe.experts.w1.weight");
    layer.w2 = find(p + "block_sparse_moe.experts.w2.weight");
    layer.w3 = find(p + "block_sparse_moe.experts.w3.weight");
    layer.input_norm = find(p + "input_layernorm.weight");
    layer.post_norm = find(p + "post_attention_layernorm.weight");
    layers_.push_back(layer);
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
  if (!config_.is_moe()) return {};
  return {{kRouterLoadBalancing, config_.router_aux_loss_coef}};
}

int64_t LlamaModel::routed_experts() const { return config_.num_local_experts; }

int LlamaModel::OwningStage(const std::string& name, int stages) const {
  const int64_t num_layers = config_.num_hidden_layers;
  if (name == "model.embed_tokens.weight") return 0;
  if (name == "model.norm.weight" || name == "lm_head.weight") {
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

torch::Tensor LlamaModel::Weight(int index) {
  const Parameter& p = parameters_[index];
  if (!p.placements.at(MeshDim::kDpShard).is_shard()) return p.tensor;
  return GatherShardedParameter(p.tensor, p.tp_local_shape[0],
                                *sharding_.dp_shard);
}

torch::Tensor LlamaModel::EnterTensorParallel(const torch::Tensor& x) {
  return sharding_.tp_size() == 1
             ? x
             : CopyToTensorParallelRegion(x, *sharding_.tp);
}

torch::Tensor LlamaModel::LeaveTensorParallel(const torch::Tensor& x) {
  return sharding_.tp_size() == 1
             ? x
             : ReduceFromTensorParallelRegion(x, *sharding_.tp);
}

torch::Tensor LlamaModel::Project(const torch::Tensor& x, int index) {
  return torch::linear(x, Weight(index));
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
  // Local head counts: a tp rank holds a contiguous block of query heads and
  // the kv heads they read, so GQA's grouping is the same locally.
  const int64_t heads = parameters_[idx.q].tp_local_shape[0] / d;
  const int64_t kv_heads = parameters_[idx.k].tp_local_shape[0] / d;
  auto split_heads = [&](const torch::Tensor& t, int64_t n) {
    return t.view({batch, seq, n, d}).transpose(1, 2);
  };
  torch::Tensor q = split_heads(Project(h, idx.q), heads);
  torch::Tensor k = split_heads(Project(h, idx.k), kv_heads);
  torch::Tensor v = split_heads(Project(h, idx.v), kv_heads);
  q = q * cos + RotateHalf(q) * sin;
  k = k * cos + RotateHalf(k) * sin;
  if (sharding_.cp_size() > 1) {
    // Before the GQA repeat, so the gather moves kv_heads, not heads.
    k = GatherSequenceBlocks(k, *sharding_.cp);
    v = GatherSequenceBlocks(v, *sharding_.cp);
  }
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
  return LeaveTensorParallel(Project(out, idx.o));
}

torch::Tensor LlamaModel::Mlp(int layer, const torch::Tensor& h,
                              int64_t ep_rows, StageIo* io) {
  const LayerIndex& idx = layers_[layer];
  if (config_.is_moe()) {
    MoeOptions options;
    options.num_experts = config_.num_local_experts;
    options.experts_per_token = config_.num_experts_per_tok;
    options.layer = first_layer_ + layer;
    options.num_layers = config_.num_hidden_layers;
    const MoeWeights weights{Weight(idx.router), Weight(idx.w1), Weight(idx.w2),
                             Weight(idx.w3)};
    return SparseMoeForward(options, h, weights, ep_rows, sharding_, io);
  }
  torch::Tensor x = EnterTensorParallel(h);
  return LeaveTensorParallel(Project(
      torch::silu(Project(x, idx.gate)) * Project(x, idx.up), idx.down));
}

torch::Tensor LlamaModel::Embed(const torch::Tensor& input,
                                int64_t vocab_start) {
  if (!first_stage()) return input;
  return sharding_.tp_size() == 1
             ? torch::embedding(Weight(embed_), input)
             : VocabParallelEmbedding(input, Weight(embed_), vocab_start,
                                      *sharding_.tp);
}

torch::Tensor LlamaModel::TargetLogprobsFromHidden(const torch::Tensor& x,
                                                   const torch::Tensor& targets,
                                                   int64_t vocab_start) {
  torch::Tensor logits = torch::linear(
      EnterTensorParallel(RmsNorm(x, Weight(final_norm_))), Weight(lm_head_));
  if (sharding_.tp_size() > 1) {
    return VocabParallelTargetLogprobs(logits, targets, vocab_start,
                                       *sharding_.tp);
  }
  return torch::log_softmax(logits, -1)
      .gather(-1, targets.unsqueeze(-1))
      .squeeze(-1);
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
    io->expert_tokens =
        torch::zeros({config_.num_hidden_layers, config_.num_local_experts},
                     torch::kFloat64);
  }
  const int64_t d = config_.head_dim();
  const auto options = torch::TensorOptions().dtype(scalar_type());

  // Rotary tables at each token's position in its sample, in the model
  // dtype: inv_freq = 1 / theta^(2i/d).
  torch::Tensor inv_freq =
      1.0 / torch::pow(config_.rope_theta, torch::arange(0, d, 2, options) /
                                               static_cast<double>(d));
  torch::Tensor freqs = layout.positions.to(scalar_type()).unsqueeze(-1) *
                        inv_freq;  // [B, T, d/2]
  torch::Tensor emb = torch::cat({freqs, freqs}, -1).unsqueeze(1);  // [B,1,T,d]
  torch::Tensor cos = emb.cos(), sin = emb.sin();

  // masked[b, 0, i, j]: key j is padding or in the future of query i.
  torch::Tensor visible =
      layout.key_valid.unsqueeze(1) &
      (layout.key_positions.unsqueeze(1) <= layout.positions.unsqueeze(2));
  torch::Tensor mask = (~visible).unsqueeze(1);  // [B, 1, T, K]

  // Rows [vocab_start, vocab_start + V / tp) of the vocabulary live here.
  const int64_t vocab_start =
      sharding_.tp_rank() * (config_.vocab_size / sharding_.tp_size());
  torch::Tensor x = Embed(input, vocab_start);
  // The expert dispatch pads every ep rank's tokens to the largest count.
  const int64_t ep_rows = config_.is_moe()
                              ? ExpertDispatchRows(batch * seq, sharding_)
                              : batch * seq;
  for (size_t layer = 0; layer < layers_.size(); ++layer) {
    const LayerIndex& idx = layers_[layer];
    x = x + Attention(static_cast<int>(layer),
                      EnterTensorParallel(RmsNorm(x, Weight(idx.input_norm))),
                      cos, sin, mask);
    x = x + Mlp(static_cast<int>(layer), RmsNorm(x, Weight(idx.post_norm)),
                ep_rows, io);
  }
  if (!last_stage()) return x;
  return TargetLogprobsFromHidden(x, targets, vocab_start);
}

}  // namespace tally
