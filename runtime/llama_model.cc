#include "runtime/llama_model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "runtime/parallel_ops.h"
#include "runtime/pipeline.h"
#include "runtime/status.h"

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

absl::Status ValidatePipelineParallel(const LlamaConfig& config, int pp) {
  if (pp > config.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.num_hidden_layers (", config.num_hidden_layers,
        ") is smaller than pp (", pp, "): every stage needs a layer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Create(
    const LlamaConfig& config, DType dtype, uint64_t seed,
    const ModelSharding& sharding) {
  TALLY_RETURN_IF_ERROR(config.Validate());
  TALLY_RETURN_IF_ERROR(ValidateTensorParallel(config, sharding.tp_size()));
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
    // tp_dim: the dim split over tp (-1: replicated over tp). Every stage
    // draws every tensor, so each is the same whatever the stage split;
    // `keep` says whether this stage holds it (-1 returned otherwise).
    auto add = [&](std::string name, std::vector<int64_t> shape, bool is_norm,
                   int tp_dim, bool keep = true) -> int {
      torch::Tensor full =
          is_norm ? torch::ones(shape, options) : torch::empty(shape, options);
      if (!is_norm) full.normal_(0.0, 0.02, generator);
      if (!keep) return -1;
      Parameter p;
      p.name = std::move(name);
      p.full_shape = shape;
      p.tp_local_shape = shape;
      if (tp_dim >= 0 && sharding.tp_size() > 1) {
        p.placements.Set(MeshDim::kTp, Placement::Shard(tp_dim));
        p.tp_local_shape[tp_dim] /= sharding.tp_size();
      }
      if (sharding.dp_shard_size() > 1) {
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
      layer.gate = add(p + "mlp.gate_proj.weight",
                       {config.intermediate_size, h}, false, 0, keep);
      layer.up = add(p + "mlp.up_proj.weight", {config.intermediate_size, h},
                     false, 0, keep);
      layer.down = add(p + "mlp.down_proj.weight",
                       {h, config.intermediate_size}, false, 1, keep);
      layer.input_norm = add(p + "input_layernorm.weight", {h}, true, -1, keep);
      layer.post_norm =
          add(p + "post_attention_layernorm.weight", {h}, true, -1, keep);
      if (keep) model->layers_.push_back(layer);
    }
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
  if (sharding_.dp_shard_size() == 1) return p.tensor;
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

AttentionLayout AttentionLayout::RightPadded(
    const std::vector<int64_t>& lengths, int64_t seq) {
  const int64_t batch = static_cast<int64_t>(lengths.size());
  AttentionLayout layout;
  layout.positions = torch::arange(seq).expand({batch, seq});
  layout.key_positions = layout.positions;
  layout.key_valid = layout.positions < torch::tensor(lengths).unsqueeze(1);
  return layout;
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

torch::Tensor LlamaModel::TargetLogprobs(const torch::Tensor& inputs,
                                         const torch::Tensor& targets,
                                         const AttentionLayout& layout) {
  TORCH_CHECK(sharding_.pp_stages == 1,
              "TargetLogprobs needs the whole model; use StageForward");
  return StageForward(inputs, targets, layout);
}

torch::Tensor LlamaModel::StageForward(const torch::Tensor& input,
                                       const torch::Tensor& targets,
                                       const AttentionLayout& layout) {
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
  for (size_t layer = 0; layer < layers_.size(); ++layer) {
    const LayerIndex& idx = layers_[layer];
    x = x + Attention(static_cast<int>(layer),
                      EnterTensorParallel(RmsNorm(x, Weight(idx.input_norm))),
                      cos, sin, mask);
    torch::Tensor h = EnterTensorParallel(RmsNorm(x, Weight(idx.post_norm)));
    x = x + LeaveTensorParallel(
                torch::linear(torch::silu(torch::linear(h, Weight(idx.gate))) *
                                  torch::linear(h, Weight(idx.up)),
                              Weight(idx.down)));
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
