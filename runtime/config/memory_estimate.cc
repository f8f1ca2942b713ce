#include "runtime/config/memory_estimate.h"

#include <algorithm>

namespace tally {
namespace {

// Of a parameter, its gradient or an optimizer moment (float32 masters for
// mixed precision); activations are counted at the same width, an upper
// bound for bfloat16's.
double DTypeBytes(DType dtype) {
  return MasterDType(dtype) == DType::kFloat64 ? 8 : 4;
}

// `copies` dp_shard-sharded copies of `params` bytes, and the full
// parameters gathered (for a pass at ZeRO stage 3, between steps at 1 and
// 2), and ZeRO-1's whole gradients.
double ShardedStateBytes(double params, double copies, int dp_shard,
                         ZeroStage zero) {
  const double shards = std::max(dp_shard, 1);
  if (shards == 1) return copies * params;
  const double whole_gradients =
      zero == ZeroStage::kOptimizerState ? params : 0;
  return copies * params / shards + params + whole_gradients;
}

// A bfloat16 model's compute-dtype copies of the weights it holds whole
// over dp_shard, kept from one forward to the next (cast once,
// runtime/model/compute_weights.h): 2 bytes a parameter. Under dp_shard > 1
// the weights held whole are the experts only (ep-sharded), and they and the
// gathered bfloat16 weights together stay within the gathered copy counted
// at the master's width.
double ComputeCopyBytes(double parameter_count, DType dtype, int dp_shard) {
  return dtype == DType::kBFloat16 && dp_shard <= 1 ? 2 * parameter_count : 0;
}

// Bytes per score element (one query x key x head of a micro-batch) that a
// ForwardBackward's attention holds at its peak, with `kept_layers` layers'
// activations kept for backward. Materialized: each kept layer's
// probabilities (the softmax's width, float32 at least, and a bfloat16
// model's bfloat16 copy for the matmul), and during the last layer's
// backward two more softmax-wide matrices (the probabilities' gradient and
// the softmax's). Blocked: nothing of T x K is kept; the block being
// computed holds about kBlockedScoreCopies matrices of T x block_keys.
double ScoreBytes(bool blocked, DType dtype, double kept_layers) {
  const double width = dtype == DType::kFloat64 ? 8 : 4;
  if (blocked) return kBlockedScoreCopies * width;
  const double copy = dtype == DType::kBFloat16 ? 2 : 0;
  return kept_layers * (width + copy) + 2 * width;
}

// The attention's bytes per token of a micro-batch whose samples are at
// most `longest` tokens, and its boolean mask when materialized. Under kAuto
// each micro-batch decides by its own length, so past the threshold a
// shorter one may still be materialized: the larger of both.
double AttentionBytesPerToken(const LlamaConfig& config, DType dtype,
                              const AttentionOptions& attention, double longest,
                              double kept_layers) {
  const double heads = config.num_attention_heads;
  const double block =
      std::min(longest, static_cast<double>(attention.block_keys));
  const double materialized =
      longest * (heads * ScoreBytes(false, dtype, kept_layers) + 1);
  const double blocked = block * heads * ScoreBytes(true, dtype, kept_layers);
  switch (attention.mode) {
    case AttentionMode::kMaterialized:
      return materialized;
    case AttentionMode::kBlocked:
      return blocked;
    default:
      if (longest <= AttentionOptions::kAutoFromKeys) return materialized;
      return std::max(
          blocked,
          AttentionBytesPerToken(config, dtype, {AttentionMode::kMaterialized},
                                 AttentionOptions::kAutoFromKeys, kept_layers));
  }
}

// The row-parallel projections (LlamaShardingPlan's kRowwise weights): their
// LoRA input of B is the compute dtype's, as on one rank.
bool RowParallel(const LoraTarget& target) {
  return target.module == "o_proj" || target.module == "down_proj";
}

// Parameters, gradients and AdamW's two moments, or SGD's none.
double StateCopies(OptimizerKind optimizer) {
  return optimizer == OptimizerKind::kAdamW ? 4 : 2;
}

}  // namespace

double ParameterCount(const LlamaConfig& config) {
  // In double: an unvalidated config's sizes may overflow an integer count.
  // Biases and q/k norms (a few vectors per layer) are left out.
  const double h = config.hidden_size, v = config.vocab_size,
               i = config.intermediate_size;
  const double d = config.num_attention_heads > 0 ? config.HeadDim() : h;
  const double q =
      config.num_attention_heads > 0 ? config.num_attention_heads * d : h;
  const double kv = static_cast<double>(config.num_key_value_heads) * d;
  const double experts = config.num_local_experts;
  const double mlp = experts > 0 ? experts * (h + 3 * h * i) : 3 * h * i;
  const double per_layer = 2 * h * q + 2 * h * kv + mlp + 2 * h;
  return v * h * (config.tie_word_embeddings ? 1 : 2) +
         config.num_hidden_layers * per_layer + h;
}

double ModelResidentBytes(const LlamaConfig& config, DType dtype,
                          OptimizerKind optimizer, int dp_shard,
                          ZeroStage zero) {
  const double count = ParameterCount(config);
  return ShardedStateBytes(count * DTypeBytes(dtype), StateCopies(optimizer),
                           dp_shard, zero) +
         ComputeCopyBytes(count, dtype, dp_shard);
}

double AdapterResidentBytes(const LlamaConfig& config, const LoraConfig& lora,
                            DType dtype, OptimizerKind optimizer, int dp_shard,
                            ZeroStage zero) {
  const auto count = static_cast<double>(LoraParameterCount(config, lora));
  return ShardedStateBytes(count * DTypeBytes(dtype), StateCopies(optimizer),
                           dp_shard, zero) +
         ComputeCopyBytes(count, dtype, dp_shard);
}

double BaseResidentBytes(const LlamaConfig& config, DType dtype, int dp_shard) {
  // Frozen: no gradient, whole or sharded.
  const double count = ParameterCount(config);
  return ShardedStateBytes(count * DTypeBytes(dtype), /*copies=*/1, dp_shard,
                           ZeroStage::kParameters) +
         ComputeCopyBytes(count, dtype, dp_shard);
}

double CallActivationBytes(const LlamaConfig& config, DType dtype,
                           const std::vector<int64_t>& sample_lengths,
                           int64_t max_batch_tokens,
                           const AttentionOptions& attention,
                           bool activation_checkpointing,
                           const TensorParallelRegion& tp_region) {
  if (sample_lengths.empty()) return 0;
  const double longest = static_cast<double>(
      *std::max_element(sample_lengths.begin(), sample_lengths.end()));
  // The largest micro-batch holds at most max_batch_tokens padded tokens,
  // or one longer sample, and never more than every sample padded to the
  // longest.
  const double tokens = std::max(
      longest, std::min(static_cast<double>(max_batch_tokens),
                        static_cast<double>(sample_lengths.size()) * longest));
  const double routed = config.num_local_experts > 0
                            ? std::max<int64_t>(config.num_experts_per_tok, 1)
                            : 1;
  const double layers = config.num_hidden_layers;
  const double layer =
      kHiddenActivationsPerToken * config.hidden_size +
      kMlpActivationsPerToken * routed * config.intermediate_size;
  // Recomputed layers keep their input only, and one layer at a time its
  // activations again during its backward.
  const double kept_layers = activation_checkpointing ? 1 : layers;
  const double saved = activation_checkpointing
                           ? layers * config.hidden_size + layer
                           : layers * layer;
  const double per_token =
      (saved + 2.0 * config.vocab_size) * DTypeBytes(dtype) +
      AttentionBytesPerToken(config, dtype, attention, longest, kept_layers);
  const double float32_region =
      tp_region.float32 ? Float32TensorParallelBytesPerToken(
                              config, tp_region.lora, activation_checkpointing)
                        : 0;
  return kActivationMargin * tokens * (per_token + float32_region);
}

double Float32TensorParallelBytesPerToken(const LlamaConfig& config,
                                          const LoraConfig& lora,
                                          bool activation_checkpointing) {
  constexpr double kFloat32Bytes = 4;
  const double h = config.hidden_size;
  const double rank = lora.enabled() ? static_cast<double>(lora.rank) : 0;
  double layer = (config.is_moe() ? 1 : 2) * h;
  for (const LoraTarget& target : LoraLayerTargets(config, lora)) {
    if (!RowParallel(target)) layer += rank;
  }
  const double unembed = h + (LoraUnembedTarget(config, lora) ? rank : 0);
  const double kept_layers =
      activation_checkpointing ? 1 : config.num_hidden_layers;
  return kFloat32Bytes * (kept_layers * layer + unembed);
}

}  // namespace tally
