#include "runtime/llama_model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/parallel_ops.h"
#include "runtime/pipeline.h"

namespace tally {

torch::ScalarType ToScalarType(DType dtype) {
  return dtype == DType::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

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

absl::Status ValidateExpertParallel(const LlamaConfig& config, int ep) {
  // A dense model has nothing to split: it runs on an ep mesh unchanged.
  if (!config.is_moe()) return absl::OkStatus();
  if (config.num_local_experts % ep != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.num_local_experts (", config.num_local_experts,
                     ") is not divisible by ep (", ep, ")"));
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

namespace {

constexpr char kExpertsInfix[] = ".block_sparse_moe.experts.";

}  // namespace

std::optional<std::pair<std::string, int64_t>> StackedExpertName(
    const std::string& hf_name) {
  const size_t at = hf_name.find(kExpertsInfix);
  if (at == std::string::npos) return std::nullopt;
  const size_t start = at + sizeof(kExpertsInfix) - 1;
  const size_t dot = hf_name.find('.', start);
  int64_t expert = 0;
  if (dot == std::string::npos ||
      !absl::SimpleAtoi(hf_name.substr(start, dot - start), &expert) ||
      expert < 0) {
    return std::nullopt;
  }
  return std::make_pair(hf_name.substr(0, start) + hf_name.substr(dot + 1),
                        expert);
}

NamedTensors ExpertWeightsToHf(NamedTensors tensors) {
  NamedTensors out;
  for (auto& [name, t] : tensors) {
    const size_t at = name.find(kExpertsInfix);
    if (at == std::string::npos) {
      out.emplace_back(std::move(name), std::move(t));
      continue;
    }
    const size_t start = at + sizeof(kExpertsInfix) - 1;
    for (int64_t e = 0; e < t.size(0); ++e) {
      out.emplace_back(
          absl::StrCat(name.substr(0, start), e, ".", name.substr(start)),
          t[e].contiguous());
    }
  }
  return out;
}

absl::StatusOr<NamedTensors> ExpertWeightsFromHf(NamedTensors tensors) {
  NamedTensors out;
  // Stacked name -> (index into out, experts by index).
  std::map<std::string, std::pair<size_t, std::map<int64_t, torch::Tensor>>>
      stacks;
  for (auto& [name, t] : tensors) {
    std::optional<std::pair<std::string, int64_t>> stacked =
        StackedExpertName(name);
    if (!stacked) {
      out.emplace_back(std::move(name), std::move(t));
      continue;
    }
    auto [it, fresh] = stacks.try_emplace(stacked->first);
    if (fresh) {
      it->second.first = out.size();
      out.emplace_back(stacked->first, torch::Tensor());
    }
    if (!it->second.second.emplace(stacked->second, std::move(t)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint weight ", name, " appears more than once"));
    }
  }
  for (auto& [stacked_name, stack] : stacks) {
    std::vector<torch::Tensor> experts;
    for (auto& [e, t] : stack.second) {
      if (e != static_cast<int64_t>(experts.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint weights of ", stacked_name,
                         " miss expert ", experts.size()));
      }
      if (!experts.empty() && t.sizes() != experts[0].sizes()) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint weights of ", stacked_name, ": expert ", e,
                         " has shape ", c10::str(t.sizes()), ", expert 0 ",
                         c10::str(experts[0].sizes())));
      }
      experts.push_back(std::move(t));
    }
    out[stack.first].second = torch::stack(experts);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Create(
    const LlamaConfig& config, DType dtype, uint64_t seed,
    const ModelSharding& sharding) {
  TALLY_RETURN_IF_ERROR(config.Validate());
  TALLY_RETURN_IF_ERROR(ValidateTensorParallel(config, sharding.tp_size()));
  TALLY_RETURN_IF_ERROR(ValidateExpertParallel(config, sharding.ep_size()));
  TALLY_RETURN_IF_ERROR(ValidatePipelineParallel(config, sharding.pp_stages));
  std::unique_ptr<LlamaModel> model(new LlamaModel(config, dtype, sharding));
  TALLY_RETURN_IF_ERROR(CatchTorch("model init", [&] {
    torch::NoGradGuard no_grad;
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto options = torch::TensorOptions().dtype(ToScalarType(dtype));
    const int64_t h = config.hidden_size, d = config.head_dim();
    const bool staged = sharding.pp_stages > 1;
    const bool first = model->first_stage(), last = model->last_stage();
    const LayerRange layers = StageLayers(
        config.num_hidden_layers, sharding.pp_stage, sharding.pp_stages);
    // tp_dim: the dim split over tp (-1: replicated over tp). Experts are
    // split over ep instead, and not over tp or dp_shard. Every stage draws
    // every tensor, so each is the same whatever the stage split; `keep`
    // says whether this stage holds it (-1 returned otherwise).
    auto add = [&](std::string name, std::vector<int64_t> shape, bool is_norm,
                   int tp_dim, bool keep = true,
                   bool is_expert = false) -> int {
      torch::Tensor full =
          is_norm ? torch::ones(shape, options) : torch::empty(shape, options);
      if (!is_norm) full.normal_(0.0, 0.02, generator);
      if (!keep) return -1;
      Parameter p;
      p.name = std::move(name);
      p.full_shape = shape;
      p.tp_local_shape = shape;
      p.is_expert = is_expert;
      if (is_expert) {
        p.placements.Set(MeshDim::kEp, Placement::Shard(0));
      } else if (tp_dim >= 0 && sharding.tp_size() > 1) {
        p.placements.Set(MeshDim::kTp, Placement::Shard(tp_dim));
        p.tp_local_shape[tp_dim] /= sharding.tp_size();
      }
      if (!is_expert && sharding.dp_shard_size() > 1) {
        p.placements.Set(MeshDim::kDpShard, Placement::Shard(0));
      }
      // A tied embedding stays Replicate: its copies on the first and last
      // stage are one parameter, counted once (on stage 0).
      if (staged && !(config.tie_word_embeddings &&
                      p.name == "model.embed_tokens.weight")) {
        p.placements.Set(MeshDim::kPp, Placement::Shard(0));
      }
      p.tensor = model->LocalShard(p, full).set_requires_grad(true);
      model->parameters_.push_back(std::move(p));
      return static_cast<int>(model->parameters_.size()) - 1;
    };
    model->embed_ =
        add("model.embed_tokens.weight", {config.vocab_size, h}, false, 0,
            first || (last && config.tie_word_embeddings));
    for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      const bool keep = i >= layers.begin && i < layers.end;
      LayerIndex layer;
      layer.q = add(p + "self_attn.q_proj.weight",
                    {config.num_attention_heads * d, h}, false, 0, keep);
      layer.k = add(p + "self_attn.k_proj.weight",
                    {config.num_key_value_heads * d, h}, false, 0, keep);
      layer.v = add(p + "self_attn.v_proj.weight",
                    {config.num_key_value_heads * d, h}, false, 0, keep);
      layer.o = add(p + "self_attn.o_proj.weight",
                    {h, config.num_attention_heads * d}, false, 1, keep);
      const int64_t inter = config.intermediate_size;
      if (config.is_moe()) {
        const int64_t experts = config.num_local_experts;
        const std::string moe = p + "block_sparse_moe.";
        layer.router = add(moe + "gate.weight", {experts, h}, false, -1, keep);
        layer.w1 = add(moe + "experts.w1.weight", {experts, inter, h}, false,
                       -1, keep, /*is_expert=*/true);
        layer.w2 = add(moe + "experts.w2.weight", {experts, h, inter}, false,
                       -1, keep, /*is_expert=*/true);
        layer.w3 = add(moe + "experts.w3.weight", {experts, inter, h}, false,
                       -1, keep, /*is_expert=*/true);
      } else {
        layer.gate =
            add(p + "mlp.gate_proj.weight", {inter, h}, false, 0, keep);
        layer.up = add(p + "mlp.up_proj.weight", {inter, h}, false, 0, keep);
        layer.down =
            add(p + "mlp.down_proj.weight", {h, inter}, false, 1, keep);
      }
      layer.input_norm = add(p + "input_layernorm.weight", {h}, true, -1, keep);
      layer.post_norm =
          add(p + "post_attention_layernorm.weight", {h}, true, -1, keep);
      if (keep) model->layers_.push_back(layer);
    }
    model->first_layer_ = layers.begin;
    model->final_norm_ = add("model.norm.weight", {h}, true, -1, last);
    model->lm_head_ =
        config.tie_word_embeddings
            ? (last ? model->embed_ : -1)
            : add("lm_head.weight", {config.vocab_size, h}, false, 0, last);
    if (!first) model->embed_ = -1;
  }));
  return model;
}

torch::Tensor LlamaModel::LocalShard(const Parameter& p,
                                     const torch::Tensor& full) const {
  torch::Tensor local = full;
  if (p.placements.at(MeshDim::kEp).is_shard()) {
    local = local.chunk(sharding_.ep_size(), 0)[sharding_.ep_rank()];
  }
  const Placement& tp = p.placements.at(MeshDim::kTp);
  if (tp.is_shard()) {
    local =
        local.chunk(sharding_.tp_size(), tp.shard_dim())[sharding_.tp_rank()];
  }
  if (p.placements.at(MeshDim::kDpShard).is_shard()) {
    local =
        ShardDim0(local, sharding_.dp_shard_rank(), sharding_.dp_shard_size());
  }
  return local.contiguous().clone();
}

absl::StatusOr<torch::Tensor> LlamaModel::GatherFull(
    const Parameter& p, const torch::Tensor& local) {
  torch::Tensor t = local.detach();
  if (p.placements.at(MeshDim::kEp).is_shard() && sharding_.ep_size() > 1) {
    TALLY_ASSIGN_OR_RETURN(t, sharding_.ep->AllGather(t.contiguous()));
  }
  if (p.placements.at(MeshDim::kDpShard).is_shard()) {
    TALLY_ASSIGN_OR_RETURN(t, sharding_.dp_shard->AllGather(t));
    t = t.narrow(0, 0, p.tp_local_shape[0]);
  }
  const Placement& tp = p.placements.at(MeshDim::kTp);
  if (tp.is_shard()) {
    // AllGather concatenates along dim 0: move the split dim there and back.
    const int dim = tp.shard_dim();
    TALLY_ASSIGN_OR_RETURN(
        t, sharding_.tp->AllGather(t.transpose(0, dim).contiguous()));
    t = t.transpose(0, dim);
  }
  return t.contiguous();
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

Parameter* LlamaModel::Find(const std::string& name) {
  for (Parameter& p : parameters_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

Parameter* LlamaModel::SplitTiedEmbedding() {
  if (!config_.tie_word_embeddings || sharding_.pp_stages == 1) return nullptr;
  if (first_stage()) return &parameters_[embed_];
  if (last_stage()) return &parameters_[lm_head_];
  return nullptr;
}

uint64_t LlamaModel::NumParameters() const {
  uint64_t n = 0;
  for (const Parameter& p : parameters_) {
    uint64_t numel = 1;
    for (int64_t size : p.full_shape) numel *= size;
    n += numel;
  }
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
  // Local head counts: a tp rank holds a contiguous block of query heads and
  // the kv heads they read, so GQA's grouping is the same locally.
  const int64_t heads = parameters_[idx.q].tp_local_shape[0] / d;
  const int64_t kv_heads = parameters_[idx.k].tp_local_shape[0] / d;
  auto split_heads = [&](const torch::Tensor& t, int64_t n) {
    return t.view({batch, seq, n, d}).transpose(1, 2);
  };
  torch::Tensor q = split_heads(torch::linear(h, Weight(idx.q)), heads);
  torch::Tensor k = split_heads(torch::linear(h, Weight(idx.k)), kv_heads);
  torch::Tensor v = split_heads(torch::linear(h, Weight(idx.v)), kv_heads);
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
  return LeaveTensorParallel(torch::linear(out, Weight(idx.o)));
}

torch::Tensor LlamaModel::Mlp(int layer, const torch::Tensor& h,
                              int64_t ep_rows, RouterStats* stats) {
  const LayerIndex& idx = layers_[layer];
  if (config_.is_moe()) return SparseMoe(layer, h, ep_rows, stats);
  torch::Tensor x = EnterTensorParallel(h);
  return LeaveTensorParallel(
      torch::linear(torch::silu(torch::linear(x, Weight(idx.gate))) *
                        torch::linear(x, Weight(idx.up)),
                    Weight(idx.down)));
}

torch::Tensor LlamaModel::SparseMoe(int layer, const torch::Tensor& h,
                                    int64_t ep_rows, RouterStats* stats) {
  const LayerIndex& idx = layers_[layer];
  const int64_t hidden = h.size(-1), tokens = h.numel() / hidden;
  const int64_t experts = config_.num_local_experts;
  // Replicated over tp: every tp rank computes the whole layer, so it needs
  // no tp region (the residual stream is identical on the tp ranks).
  torch::Tensor x = h.reshape({tokens, hidden});
  torch::Tensor probs =
      torch::softmax(torch::linear(x, Weight(idx.router)), -1);
  auto [top_probs, top_experts] =
      probs.topk(config_.num_experts_per_tok, /*dim=*/-1);
  torch::Tensor top_sum = top_probs.sum(-1, /*keepdim=*/true);
  if (stats != nullptr) {
    const torch::Tensor real = stats->real_tokens.reshape({tokens});
    stats->expert_tokens[first_layer_ + layer].index_add_(
        0, top_experts.masked_select(real.unsqueeze(1)),
        torch::ones({real.sum().item<int64_t>() * top_experts.size(1)},
                    torch::kFloat64));
    torch::Tensor aux =
        (static_cast<double>(experts) / config_.num_hidden_layers) *
        top_sum.squeeze(1).view(h.sizes().slice(0, 2));
    stats->aux = stats->aux.defined() ? stats->aux + aux : aux;
  }
  top_probs = top_probs / top_sum;
  // combine[n, e]: token n's weight for expert e, zero outside its top k.
  torch::Tensor combine =
      torch::zeros_like(probs).scatter(1, top_experts, top_probs);
  const int ep = sharding_.ep_size();
  if (ep > 1) {
    // Dispatch: every rank's tokens and weights, padded to ep_rows (padding
    // rows have zero weight for every expert, so no expert computes them).
    torch::Tensor block = torch::cat({x, combine}, 1);
    block =
        torch::cat({block, torch::zeros({ep_rows - tokens, hidden + experts},
                                        block.options())});
    torch::Tensor all =
        GatherShardedParameter(block, ep * ep_rows, *sharding_.ep);
    x = all.narrow(1, 0, hidden);
    combine = all.narrow(1, hidden, experts);
  }
  const int64_t local_experts = experts / ep;
  const int64_t first = sharding_.ep_rank() * local_experts;
  const torch::Tensor w1 = Weight(idx.w1), w2 = Weight(idx.w2),
                      w3 = Weight(idx.w3);
  torch::Tensor out = torch::zeros_like(x);
  for (int64_t e = 0; e < local_experts; ++e) {
    torch::Tensor weight = combine.select(1, first + e);
    // An expert without tokens still runs (on zero rows): it contributes
    // zero, and its weights get a (zero) gradient on every rank alike.
    torch::Tensor rows = weight.detach().nonzero().squeeze(1);
    torch::Tensor xe = x.index_select(0, rows);
    torch::Tensor ye = torch::linear(
        torch::silu(torch::linear(xe, w1[e])) * torch::linear(xe, w3[e]),
        w2[e]);
    out =
        out.index_add(0, rows, ye * weight.index_select(0, rows).unsqueeze(1));
  }
  if (ep > 1) {
    // Combine: each token's partial outputs summed on its owner.
    out = ReduceScatterRows(out, *sharding_.ep).narrow(0, 0, tokens);
  }
  return out.view(h.sizes());
}

torch::Tensor LlamaModel::TargetLogprobs(const torch::Tensor& inputs,
                                         const torch::Tensor& targets,
                                         const AttentionLayout& layout,
                                         RouterStats* router_stats) {
  TORCH_CHECK(sharding_.pp_stages == 1,
              "TargetLogprobs needs the whole model; use StageForward");
  if (router_stats != nullptr) router_stats->aux = torch::Tensor();
  return StageForward(inputs, targets, layout, router_stats);
}

torch::Tensor LlamaModel::StageForward(const torch::Tensor& input,
                                       const torch::Tensor& targets,
                                       const AttentionLayout& layout,
                                       RouterStats* router_stats) {
  // [B, T]: the token ids, or the leading dims of the hidden states.
  const int64_t batch = input.size(0), seq = input.size(1);
  if (!config_.is_moe()) router_stats = nullptr;
  if (router_stats != nullptr) {
    TORCH_CHECK(
        router_stats->real_tokens.sizes() == c10::IntArrayRef({batch, seq}),
        "router_stats.real_tokens must be shaped [B, T] like input");
    router_stats->expert_tokens =
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
  torch::Tensor x = input;
  if (first_stage()) {
    x = sharding_.tp_size() == 1
            ? torch::embedding(Weight(embed_), input)
            : VocabParallelEmbedding(input, Weight(embed_), vocab_start,
                                     *sharding_.tp);
  }
  // The expert dispatch pads every ep rank's tokens to the largest count.
  int64_t ep_rows = batch * seq;
  if (config_.is_moe() && sharding_.ep_size() > 1) {
    torch::Tensor rows =
        torch::tensor({static_cast<double>(ep_rows)}, torch::kFloat64);
    const absl::Status reduced = sharding_.ep->AllReduce(rows, ReduceOp::kMax);
    TORCH_CHECK(reduced.ok(),
                "ep token count all_reduce: ", std::string(reduced.message()));
    ep_rows = static_cast<int64_t>(rows.item<double>());
  }
  for (size_t layer = 0; layer < layers_.size(); ++layer) {
    const LayerIndex& idx = layers_[layer];
    x = x + Attention(static_cast<int>(layer),
                      EnterTensorParallel(RmsNorm(x, Weight(idx.input_norm))),
                      cos, sin, mask);
    x = x + Mlp(static_cast<int>(layer), RmsNorm(x, Weight(idx.post_norm)),
                ep_rows, router_stats);
  }
  if (!last_stage()) return x;
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

}  // namespace tally
