// Plain value types of the tally runtime: what a training command takes and
// returns. They mirror tally.v1 but carry no protobuf, so the runtime can be
// driven in process (tests, benchmarks) exactly as the server drives it.
#ifndef TALLY_RUNTIME_CONFIG_TYPES_H_
#define TALLY_RUNTIME_CONFIG_TYPES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "base/dtype_names.h"
#include "base/enum_names.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/lora_config.h"
#include "runtime/config/loss_spec.h"

namespace tally {

// kBFloat16 is mixed precision: float32 parameters, gradients and optimizer
// state (the master copy), matmuls and activations in bfloat16.
enum class DType { kFloat32, kFloat64, kBFloat16 };
enum class OptimizerKind { kAdamW, kSgd };
enum class LossReduction { kTokenMean, kSampleMean, kSum };
enum class NormType { kL2, kInf };
enum class NonFinitePolicy { kSkip, kError };
// When data-parallel replicas sum their gradients: after every
// ForwardBackward (EAGER) or once at OptimStep (DEFERRED, DDP's no_sync).
enum class GradSync { kEager, kDeferred };
// What the dp_shard dimension shards (ZeRO's stages; docs/distributed.md,
// "ZeRO stages"): the optimizer state (1), and the gradients (2), and the
// parameters (3, FSDP). Under 1 and 2 every rank keeps the parameters
// gathered between optimizer steps. A per-server choice (--zero-stage).
enum class ZeroStage { kOptimizerState = 1, kGradients = 2, kParameters = 3 };
// The ZeroStage numbered `stage`; nullopt for any other number.
std::optional<ZeroStage> ZeroStageNumbered(int64_t stage);

const char* DTypeName(DType dtype);  // "float32"
// The DType DTypeName calls `name`; nullopt for any other name.
std::optional<DType> DTypeNamed(absl::string_view name);
// The dtype parameters, gradients and optimizer state are kept in: float32
// for a kBFloat16 (mixed-precision) model, else `dtype`.
DType MasterDType(DType dtype);
const char* OptimizerName(OptimizerKind optimizer);  // "adamw"
const char* ReductionName(LossReduction reduction);  // "token_mean"

// How a model's attention is computed (runtime/model/blocked_attention.h): the
// whole [T, K] score matrix per head (materialized), or blocks of keys with
// an online softmax whose extra memory is O(T x block) per head (blocked).
// The results are the same to rounding.
enum class AttentionMode { kAuto, kMaterialized, kBlocked };
const char* AttentionModeName(AttentionMode mode);  // "auto"
std::optional<AttentionMode> AttentionModeNamed(absl::string_view name);

// The names of these enums, one table each (base/enum_names.h): what
// tally.json, flags and logs call them. DTypeName, OptimizerName and the like
// read these; so do parsers that list the accepted names in an error.
//
//   std::optional<GradSync> sync = ValueNamed(kGradSyncNames, "deferred");
//   std::string expected = NameList(kDTypeNames, "\"");
//   // "\"float32\", \"float64\" or \"bfloat16\""
// A DType has its base/dtype_names.h name (float16 is no DType: only an
// export stores it).
inline constexpr EnumName<DType> kDTypeNames[] = {
    {DType::kFloat32, NameOf(kDataTypeNames, DataType::kFloat32)},
    {DType::kFloat64, NameOf(kDataTypeNames, DataType::kFloat64)},
    {DType::kBFloat16, NameOf(kDataTypeNames, DataType::kBFloat16)},
};
inline constexpr EnumName<OptimizerKind> kOptimizerNames[] = {
    {OptimizerKind::kAdamW, "adamw"},
    {OptimizerKind::kSgd, "sgd"},
};
inline constexpr EnumName<LossReduction> kReductionNames[] = {
    {LossReduction::kTokenMean, "token_mean"},
    {LossReduction::kSampleMean, "sample_mean"},
    {LossReduction::kSum, "sum"},
};
inline constexpr EnumName<GradSync> kGradSyncNames[] = {
    {GradSync::kEager, "eager"},
    {GradSync::kDeferred, "deferred"},
};
inline constexpr EnumName<AttentionMode> kAttentionModeNames[] = {
    {AttentionMode::kAuto, "auto"},
    {AttentionMode::kMaterialized, "materialized"},
    {AttentionMode::kBlocked, "blocked"},
};

struct AttentionOptions {
  // kAuto: blocked when a micro-batch's rows have more than kAutoFromKeys
  // keys (tokens, or under context parallelism the cp group's tokens).
  static constexpr int64_t kAutoFromKeys = 2048;
  AttentionMode mode = AttentionMode::kAuto;
  int64_t block_keys = 512;  // keys per block of the blocked path (>= 1)

  bool Blocked(int64_t keys) const {
    return mode == AttentionMode::kBlocked ||
           (mode == AttentionMode::kAuto && keys > kAutoFromKeys);
  }
};

// Target value that marks a position as ignored (HF / PyTorch convention).
inline constexpr int32_t kIgnoreIndex = -100;

struct AdamParams {
  double learning_rate = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

// Per-step overrides; an unset field takes the model default.
struct AdamOverrides {
  std::optional<double> learning_rate;
  std::optional<double> beta1;
  std::optional<double> beta2;
  std::optional<double> eps;
  std::optional<double> weight_decay;

  AdamParams ResolveAgainst(const AdamParams& defaults) const;
};

struct ModelSpec {
  std::string model_id;
  LlamaConfig config;
  uint64_t seed = 0;
  DType dtype = DType::kFloat32;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  AdamParams default_adam;
  double default_max_grad_norm = 0.0;
  GradSync grad_sync = GradSync::kEager;
  // Tally checkpoint or HF directory of a supported family. Its config.json is
  // used; a `config` given as well (vocab_size != 0) must equal it.
  std::string init_checkpoint;
  // Parameters that do not train (CausalLm::Freeze patterns, '*' for a layer
  // number); each must match a parameter of the model.
  std::vector<std::string> frozen;
  // Recompute each decoder layer in backward instead of keeping its
  // activations (CausalLm::set_recompute_layers): same results, less
  // memory, one more forward per call.
  bool activation_checkpointing = false;
  // rank > 0: the model is a LoRA adapter over a frozen base, built from
  // init_checkpoint (or config and seed) and shared by every adapter with
  // the same BaseKey.
  LoraConfig lora;
};

// What identifies the frozen base a LoRA model shares with others: its
// tenant scope (the "<tenant>/" of a scoped model id), dtype, and its
// init_checkpoint (normalized) with `checkpoint_identity`, what identifies
// the directory's contents (CurrentBaseKey passes its DirectoryIdentity, so
// a directory published again at the path is another base), or its config
// and seed. Empty for a model without an adapter.
std::string BaseKey(const ModelSpec& spec,
                    absl::string_view checkpoint_identity);

struct Sample {
  std::vector<int32_t> input_tokens;
  std::vector<int32_t> target_tokens;
  std::vector<float> weights;  // empty: all 1
  // Further per-token inputs of the loss by name (TokenLoss::
  // required_inputs), each as long as input_tokens.
  std::map<std::string, std::vector<float>> token_inputs;
};

struct ForwardBackwardArgs {
  std::vector<Sample> samples;
  LossReduction reduction = LossReduction::kTokenMean;
  bool forward_only = false;
  bool return_logprobs = false;
  // The per-token objective (loss_registry.h builds it).
  LossSpec loss;
};

// How far the trainer's policy is from the sampler's over valid tokens
// (v1::PolicyStats): with d = logp - sampling_logp and ratio = exp(d).
struct PolicyStats {
  int64_t tokens = 0;  // 0: every other field is 0
  double ratio_mean = 0.0;
  double ratio_min = 0.0;
  double ratio_max = 0.0;
  double clipped_fraction = 0.0;  // ratio outside the loss's clip range
  double logprob_gap_mean = 0.0;  // mean |d|
  double logprob_gap_max = 0.0;   // max |d|
  double kl_k1 = 0.0;             // mean(-d)
  double kl_k3 = 0.0;             // mean(ratio - 1 - d)
};

struct SampleResult {
  double loss_sum = 0.0;
  int64_t valid_tokens = 0;
  std::vector<double> logprobs;      // with return_logprobs
  std::vector<double> token_losses;  // with return_logprobs: w * loss
  // When every sample of the call carries sampling_logprobs.
  std::optional<PolicyStats> policy;
};

// The pending accumulation window of a model.
struct WindowCounts {
  int64_t calls = 0;
  int64_t tokens = 0;
  int64_t samples = 0;  // samples with at least one valid token
  std::optional<LossReduction> reduction;  // unset when nothing is pending
};

struct ForwardBackwardResult {
  double loss_sum = 0.0;
  double loss_mean = 0.0;
  int64_t valid_tokens = 0;
  int64_t num_samples = 0;
  std::vector<SampleResult> samples;
  WindowCounts window;  // after this call
  std::map<std::string, double> metrics;
  std::optional<PolicyStats> policy;  // over every sample, as SampleResult's
};

struct OptimStepArgs {
  AdamOverrides adam;
  std::optional<double> max_grad_norm;  // unset: model default; 0: no clip
  NormType norm_type = NormType::kL2;
  NonFinitePolicy nonfinite = NonFinitePolicy::kSkip;
};

// INVALID_ARGUMENT naming `field` unless `max_grad_norm` is finite and >= 0
// (0: no clipping). The one rule for every place a clip threshold enters.
absl::Status ValidateMaxGradNorm(double max_grad_norm, absl::string_view field);

struct OptimStepResult {
  int64_t step = 0;
  double grad_norm = 0.0;
  double clip_coef = 1.0;
  double normalizer = 0.0;
  bool skipped = false;
  std::string skip_reason;
  double learning_rate = 0.0;
  std::map<std::string, double> metrics;
};

struct ModelSummary {
  std::string model_id;
  LlamaConfig config;
  uint64_t num_parameters = 0;
  int64_t step = 0;
  WindowCounts window;
  DType dtype = DType::kFloat32;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  AdamParams default_adam;
  double default_max_grad_norm = 0.0;
  GradSync grad_sync = GradSync::kEager;
  bool activation_checkpointing = false;
  LoraConfig lora;   // rank 0: a full model
  std::string base;  // a LoRA model's BaseKey, else empty
  // What trains: a LoRA model's adapter parameters, a full model's
  // num_parameters; in parameters and in bytes as kept (MasterDType).
  uint64_t trainable_parameters = 0;
  uint64_t trainable_bytes = 0;
  // Non-empty when the parameters may be partly updated (an OptimStep or a
  // LoadCheckpoint failed midway): why. Only a LoadCheckpoint repairs it.
  std::string damage;
  // What ends a Sample with no stop conditions of its own: the
  // init_checkpoint's eos_token_id (runtime/config/generation_config.h).
  std::vector<int64_t> eos_token_ids;
};

struct SaveOptions {
  // Save although an accumulation window is pending. Its gradients are not
  // in the checkpoint; the model keeps them.
  bool allow_pending = false;
  // Opaque bytes of the server (its sequencing state), stored as they are.
  std::string server_state;
  // Write the trainable parameters only (an adapter without its frozen
  // base); loading it leaves the frozen ones as they are.
  bool trainable_only = false;
};

struct SaveResult {
  std::string path;
  int64_t step = 0;
  uint64_t bytes_written = 0;
  // The pending window the checkpoint does not hold (calls = 0: none).
  WindowCounts unsaved_window;
};

struct LoadResult {
  ModelSummary model;
  WindowCounts discarded;
  std::string server_state;  // as SaveOptions::server_state was
  // The pending window the checkpoint's save dropped (allow_pending).
  WindowCounts unsaved_window;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_TYPES_H_
