// LoRA: PEFT's low-rank adapters on a model's projections, and the files
// they travel in. An adapted projection computes
//
//   y = x W^T + b + (alpha / rank) * (x A^T) B^T
//
// with A [rank, in] drawn Kaiming-uniform (a = sqrt(5)) and B [out, rank]
// zero, held as parameters named after their projection, as PEFT names them
// ("model.layers.0.self_attn.q_proj.lora_A.weight"). The base W stays frozen
// and may be shared by many adapters (CausalLm's ModelAdapters).
//
// Layout under tensor parallelism (no collective in the forward beyond the
// base layer's): a column-parallel base (q, k, v, gate, up, lm_head) keeps A
// whole on every tp rank and splits B by output rows like W; a row-parallel
// base (o, down) splits A by input columns like W and keeps B whole, its
// partial product joining the base's before the tp reduction. The whole
// factor's gradient is partial per tp rank and is summed over tp in
// backward, as for the replicated norms. Over dp_shard both shard on dim 0
// like every parameter.
//
// Files: WriteWeightsExport (weights_export.h) writes an adapter as PEFT's
// adapter_config.json + adapter_model.safetensors (keys prefixed
// "base_model.model."), or merged into its base; ReadAdapter
// (lora_adapter_reader.h) reads such a directory, or a tally checkpoint of an
// adapter, back.
//
//   torch::Tensor y = torch::linear(x, w) + tally::LoraDelta(x, a, b, 2.0);
//   TALLY_ASSIGN_OR_RETURN(tally::NamedTensors merged,
//                          tally::MergeLora(std::move(weights), 2.0));
#ifndef TALLY_RUNTIME_MODEL_LORA_H_
#define TALLY_RUNTIME_MODEL_LORA_H_

#include <torch/torch.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/lora_config.h"
#include "runtime/io/safetensors.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/pipeline.h"
#include "runtime/parallel/sharding_plan.h"

namespace tally {

inline constexpr char kPeftConfigFile[] = "adapter_config.json";
inline constexpr char kPeftWeightsFile[] = "adapter_model.safetensors";
// What PEFT puts before a model's parameter names in its files.
inline constexpr char kPeftKeyPrefix[] = "base_model.model.";

// Whether `name` is a LoRA factor ("....lora_A.weight" / "....lora_B.weight").
bool IsLoraParameter(const std::string& name);

// Adds, for every column- or row-parallel weight rule of `plan`, the rules
// of its LoRA factors (the layout above).
void AddLoraRules(ShardingPlan& plan);

// The LoRA factors of a Llama-family model, in order: each held layer's
// adapted projections (LoraLayerTargets), then the unembedding's on the last
// stage. Every layer's specs are listed; `held` layers and `last_stage` mark
// those this stage keeps.
std::vector<ParameterSpec> LoraParameterSpecs(const LlamaConfig& config,
                                              const LoraConfig& lora,
                                              const LayerRange& held,
                                              bool last_stage);

// (alpha / rank) * (x A^T) B^T for `a` [r, in] and `b` [out, r].
torch::Tensor LoraDelta(const torch::Tensor& x, const torch::Tensor& a,
                        const torch::Tensor& b, double scaling);

// LoraDelta inside the tensor-parallel region of a bfloat16 model, whose
// partial sums over tp stay in float32 (runtime/parallel/parallel_ops.h).
//
// Column-parallel projection (a whole, b this rank's rows): x is the
// region's float32 input and the result is in b's dtype, as one rank's.
// x A^T is kept in float32 (rounded as one rank rounds it) so that its
// gradient, a partial sum over tp, stays float32; A's gradient is summed
// over `tp` in float32 and rounded once, as one rank rounds it, so it is
// complete on every rank (a must not be summed over tp again).
torch::Tensor ColumnParallelLoraDelta(const torch::Tensor& x,
                                      const torch::Tensor& a,
                                      const torch::Tensor& b, double scaling,
                                      Communicator& tp);

// Row-parallel projection (a this rank's columns, b whole): x A^T, a
// partial sum, is summed over `tp` in float32 and rounded once (one small
// all-reduce of [..., r]); the rest is LoraDelta's, complete on every rank,
// so b's gradient is complete too (b must not be summed over tp again).
torch::Tensor RowParallelLoraDelta(const torch::Tensor& x,
                                   const torch::Tensor& a,
                                   const torch::Tensor& b, double scaling,
                                   Communicator& tp);

// `weights` (HF names, whole tensors) with every adapted weight replaced by
// W + scaling * B A (computed in the tensors' dtype) and the factors
// removed. A tied model's adapted head becomes an lm_head.weight of its own
// (the embedding stays W), so its config must then be untied.
// INVALID_ARGUMENT naming a factor without its pair or base weight.
absl::StatusOr<NamedTensors> MergeLora(NamedTensors weights, double scaling);

// PEFT's adapter_config.json of `lora`; `base_model` (the base's
// directory, may be empty) goes in base_model_name_or_path.
std::string PeftAdapterConfig(const LoraConfig& lora,
                              const std::string& base_model);

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_LORA_H_
