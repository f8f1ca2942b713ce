#include "runtime/memory_estimate.h"

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

// The most score columns a micro-batch's attention holds per query when its
// samples are at most `longest` tokens: each micro-batch decides by its own
// length, so under kAuto a shorter one may still be materialized.
double ScoreColumns(const AttentionOptions& attention, double longest) {
  const double block =
      std::min(longest, static_cast<double>(attention.block_keys));
  switch (attention.mode) {
    case AttentionMode::kMaterialized:
      return longest;
    case AttentionMode::kBlocked:
      return block;
    default:
      return longest <= AttentionOptions::kAutoFromKeys
                 ? longest
                 : std::max(block, static_cast<double>(
                                       AttentionOptions::kAutoFromKeys));
  }
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
  return ShardedStateBytes(ParameterCount(config) * DTypeBytes(dtype),
                           StateCopies(optimizer), dp_shard, zero);
}

double AdapterResidentBytes(const LlamaConfig& config, const LoraConfig& lora,
                            DType dtype, OptimizerKind optimizer, int dp_shard,
                            ZeroStage zero) {
  return ShardedStateBytes(LoraParameterCount(config, lora) * DTypeBytes(dtype),
                           StateCopies(optimizer), dp_shard, zero);
}

double BaseResidentBytes(const LlamaConfig& config, DType dtype, int dp_shard) {
  // Frozen: no gradient, whole or sharded.
  return ShardedStateBytes(ParameterCount(config) * DTypeBytes(dtype),
                           /*copies=*/1, dp_shard, ZeroStage::kParameters);
}

double CallActivationBytes(const LlamaConfig& config, DType dtype,
                           const std::vector<int64_t>& sample_lengths,
                           int64_t max_batch_tokens,
                           const AttentionOptions& attention) {
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
  const double per_token_layer =
      kHiddenActivationsPerToken * config.hidden_size +
      kMlpActivationsPerToken * routed * config.intermediate_size +
      2.0 * config.num_attention_heads * ScoreColumns(attention, longest);
  const double per_token =
      config.num_hidden_layers * per_token_layer + 2.0 * config.vocab_size;
  return tokens * per_token * DTypeBytes(dtype);
}

}  // namespace tally
