// Memory estimates that memory admission decides by, computed from a model's
// config and a call's shape before anything is allocated (docs/reliability.md,
// "Memory admission").
//
// Both are upper bounds per rank, kept simple on purpose: a model's resident
// state counts the dp_shard split and nothing else (tp, pp and ep would
// divide it further), plus one full gathered copy of the parameters when
// dp_shard > 1 (and ZeRO-1's whole gradients); a call's activations count its
// largest micro-batch as if one rank ran it whole. Arithmetic is in double, so
// a hostile config cannot wrap an integer around to a small number.
//
//   const double resident = tally::ModelResidentBytes(config, dtype, kind,
//                                                     mesh.dp_shard);
//   const double call = tally::CallActivationBytes(config, dtype, lengths,
//                                                  max_batch_tokens);
#ifndef TALLY_RUNTIME_CONFIG_MEMORY_ESTIMATE_H_
#define TALLY_RUNTIME_CONFIG_MEMORY_ESTIMATE_H_

#include <cstdint>
#include <vector>

#include "runtime/config/llama_config.h"
#include "runtime/config/lora_config.h"
#include "runtime/config/types.h"

namespace tally {

// Saved per token and layer for backward, in units of the dtype: the
// attention block's inputs, norms, q/k/v, output and residuals (~10 x
// hidden) and the SwiGLU MLP's gate, up, activation and product (~4 x
// intermediate, times the experts a token is routed to).
inline constexpr double kHiddenActivationsPerToken = 10;
inline constexpr double kMlpActivationsPerToken = 4;
// Matrices of T x block_keys per head the blocked attention's block holds at
// its peak (scores, probabilities and their gradients; measured 3.75 to 4).
inline constexpr double kBlockedScoreCopies = 4;
// Room over the modelled activations for what the model leaves out (the
// kernels' temporaries, allocator rounding): tests/unit/
// activation_estimate_test.cc measures the estimate within [1, 1.5] of a
// call's real peak over a grid of shapes.
inline constexpr double kActivationMargin = 1.1;

// Parameter count, in double (LlamaConfig::NumParameters is exact but can
// wrap for absurd configs).
double ParameterCount(const LlamaConfig& config);

// Parameters, gradients and optimizer state (AdamW: two moments; SGD: none)
// of one rank, in bytes, and a bfloat16 model's bfloat16 copies of its
// weights (cast once, runtime/model/compute_weights.h); `config` with
// defaults applied.
double ModelResidentBytes(const LlamaConfig& config, DType dtype,
                          OptimizerKind optimizer, int dp_shard,
                          ZeroStage zero = ZeroStage::kParameters);
// The same for a LoRA model's own state: the adapter's parameters,
// gradients and optimizer state. Its base is counted apart, once for all
// the adapters sharing it: parameters only (frozen), with the gathered copy
// under dp_shard.
double AdapterResidentBytes(const LlamaConfig& config, const LoraConfig& lora,
                            DType dtype, OptimizerKind optimizer, int dp_shard,
                            ZeroStage zero = ZeroStage::kParameters);
double BaseResidentBytes(const LlamaConfig& config, DType dtype, int dp_shard);

// The activations one ForwardBackward holds at its peak, in bytes: its
// largest micro-batch (PlanBatches packs at most max_batch_tokens padded
// tokens, or one longer sample) times each layer's saved activations (with
// activation checkpointing, each layer's input and one layer's activations
// at a time), the logits with their log-softmax (2 x vocab per token), and
// the attention: materialized, each kept layer's probabilities plus two
// more T x T matrices per head during a layer's backward (a bfloat16 model
// keeps a bfloat16 copy of the probabilities too), and the boolean mask;
// blocked, kBlockedScoreCopies T x block_keys matrices per head. Under kAuto
// past the threshold the larger of the blocked bound and a materialized
// micro-batch of the threshold's length. A model whose tp linears keep
// float32 (`tp_region.float32`) adds Float32TensorParallelBytesPerToken.
// Times kActivationMargin.
struct TensorParallelRegion {
  // TensorParallelInFloat32 (runtime/model/llama_model.h) holds for the model.
  bool float32 = false;
  LoraConfig lora;  // the model's adapter (rank 0: a full model)
};
double CallActivationBytes(const LlamaConfig& config, DType dtype,
                           const std::vector<int64_t>& sample_lengths,
                           int64_t max_batch_tokens,
                           const AttentionOptions& attention = {},
                           bool activation_checkpointing = false,
                           const TensorParallelRegion& tp_region = {});

// What the float32 tensor-parallel region (TensorParallelInFloat32) keeps
// for backward beyond the dtype's activations, in bytes per token: each kept
// layer's region inputs widened to float32 (the attention's, and the MLP's
// unless mixture-of-experts), and the [tokens, rank] float32 input of B of
// each adapted column-parallel projection (q, k, v, gate, up); once, the
// unembedding's region input and its LoRA piece. With activation
// checkpointing one layer's at a time.
double Float32TensorParallelBytesPerToken(const LlamaConfig& config,
                                          const LoraConfig& lora,
                                          bool activation_checkpointing);

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_MEMORY_ESTIMATE_H_
