// LoraConfig: which projections of a model carry PEFT's low-rank adapters,
// at what rank and scale, and where their first values come from. A model
// with a LoraConfig is an adapter over a frozen base (runtime/model/lora.h has
// the math and the PEFT files); this header is torch-free, so the server's
// request parsing and memory admission use it too.
//
//   tally::LoraConfig lora;
//   lora.rank = 16;
//   lora = lora.WithDefaults();  // alpha 32
//   TALLY_RETURN_IF_ERROR(tally::ValidateLoraConfig(lora));
//   // W x + (alpha / rank) * B A x on every projection LoraTargetModules names
//   double scale = lora.scaling();
#ifndef TALLY_RUNTIME_CONFIG_LORA_CONFIG_H_
#define TALLY_RUNTIME_CONFIG_LORA_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "runtime/config/llama_config.h"

namespace tally {

// Tinker's LoRA scale numerator: alpha when a request leaves it unset.
inline constexpr double kDefaultLoraAlpha = 32;
// The largest rank a request may ask for.
inline constexpr int64_t kMaxLoraRank = 1024;

struct LoraConfig {
  int64_t rank = 0;  // 0: no adapter, a full model
  double alpha = 0;  // 0 until WithDefaults: kDefaultLoraAlpha
  // Tinker's switches: q, k, v and o projections; the MLP's gate, up and down
  // projections; the unembedding (lm_head).
  bool train_attn = true;
  bool train_mlp = true;
  bool train_unembed = true;
  // Draws A (B starts at zero); unset: the model's seed.
  std::optional<uint64_t> seed;
  // A PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
  // or a tally checkpoint of an adapter to start from instead of the draw.
  std::string init_adapter;

  bool enabled() const { return rank > 0; }
  // PEFT's scaling: alpha / rank.
  double scaling() const { return alpha / static_cast<double>(rank); }
  LoraConfig WithDefaults() const;
};

// INVALID_ARGUMENT naming the field ("lora.rank", ...) of a config that
// cannot be built: rank outside [1, kMaxLoraRank], alpha not finite and > 0,
// no target switched on.
absl::Status ValidateLoraConfig(const LoraConfig& lora);

// Whether adapters of `a` and `b` have the same factors and scale: rank,
// alpha and target modules (a checkpoint of one loads into the other).
bool SameAdapterShape(const LoraConfig& a, const LoraConfig& b);

// The PEFT module names (target_modules) the adapter covers, in the order of
// a layer's projections, "lm_head" last.
std::vector<std::string> LoraTargetModules(const LoraConfig& lora);

// INVALID_ARGUMENT naming the field when `lora` does not fit the model of
// `config`: lora.train_mlp on a mixture-of-experts model (its experts take
// no adapters yet).
absl::Status ValidateLoraForModel(const LlamaConfig& config,
                                  const LoraConfig& lora);

// One adapted projection: its PEFT module name ("q_proj"), its path under
// "model.layers.<i>." ("self_attn.q_proj"; for the unembedding the whole
// name, "lm_head") and the base weight's [out_features, in_features].
struct LoraTarget {
  std::string module;
  std::string path;
  int64_t out_features = 0;
  int64_t in_features = 0;
};
// The projections of one decoder layer the adapter covers, in order
// (`config` with defaults applied).
std::vector<LoraTarget> LoraLayerTargets(const LlamaConfig& config,
                                         const LoraConfig& lora);
// The adapted unembedding, when lora.train_unembed.
std::optional<LoraTarget> LoraUnembedTarget(const LlamaConfig& config,
                                            const LoraConfig& lora);

// The adapter's parameter count: rank * (in + out) per adapted projection,
// in double (admission arithmetic, see memory_estimate.h).
double LoraParameterCount(const LlamaConfig& config, const LoraConfig& lora);

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_LORA_CONFIG_H_
