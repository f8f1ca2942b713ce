// ModelFamily: what makes one HF decoder family (config.json "model_type")
// differ from Llama, at the config level. Every supported family is the same
// decoder — RMSNorm, GQA attention with rotate-half RoPE, a SwiGLU MLP or a
// sparse MoE block — plus the features a family switches on (biases, q/k
// norms, a sliding attention window), the way transformers derives Qwen2,
// Qwen3 and Mistral from Llama. A family reads and writes the config.json
// fields that are its own, refuses those it does not implement naming the
// field, says which features a config turns on, and checks the combination.
// Each family lives in runtime/config/families/<model_type>.cc;
// runtime/config/families/registry.h finds one by name. The model code reads
// only Features().
//
//   TALLY_ASSIGN_OR_RETURN(const tally::ModelFamily* family,
//                          tally::FindModelFamily("qwen3"));  // registry.h
//   tally::ModelFeatures features = family->Features(config);
//   if (features.qk_norm) { ... }
#ifndef TALLY_RUNTIME_CONFIG_MODEL_FAMILY_H_
#define TALLY_RUNTIME_CONFIG_MODEL_FAMILY_H_

#include <cstdint>
#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tally {

// Declared, not included: LlamaConfig's methods ask its family (Validate,
// FromHfJson, ToHfJson), so llama_config.cc includes this header and
// llama_config.h stays out of it. A family's file includes both.
struct LlamaConfig;

// The architecture switches of the shared decoder.
struct ModelFeatures {
  bool qkv_bias = false;  // q_proj, k_proj, v_proj have a bias
  bool o_bias = false;    // o_proj has a bias
  bool mlp_bias = false;  // gate_proj, up_proj, down_proj have a bias
  // Per-head RMSNorm of queries and keys over head_dim, before RoPE
  // (self_attn.q_norm.weight, self_attn.k_norm.weight).
  bool qk_norm = false;
};

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;

  // config.json "model_type" and "architectures"[0].
  virtual const char* model_type() const = 0;
  virtual const char* architecture() const = 0;

  // Fills what transformers' config class defaults for fields a config.json
  // may leave out (before the file's values are read).
  virtual void ApplyHfDefaults(LlamaConfig& config) const {}
  // Reads the fields only this family has (the shared Llama fields are read
  // already) and refuses what it does not implement: INVALID_ARGUMENT
  // naming "config.json <field>".
  virtual absl::Status ReadHfFields(const nlohmann::json& json,
                                    LlamaConfig& config) const = 0;
  // Writes the family's own fields into `json` (shared fields are written).
  virtual void WriteHfFields(const LlamaConfig& config,
                             nlohmann::ordered_json& json) const = 0;

  virtual ModelFeatures Features(const LlamaConfig& config) const = 0;
  // The sliding window of layer `layer`: a query attends to the keys at
  // most window - 1 positions before it. 0: the whole causal prefix.
  virtual int64_t AttentionWindow(const LlamaConfig& config,
                                  int64_t layer) const {
    return 0;
  }
  // INVALID_ARGUMENT naming "config.<field>" for a field this family does
  // not have or a combination it does not allow.
  virtual absl::Status Validate(const LlamaConfig& config) const = 0;
};

// Helpers for family files: read config.json `key` into `out` when present
// and not null; INVALID_ARGUMENT naming the key for a wrong JSON type.
absl::Status ReadJsonInt(const nlohmann::json& json, const char* key,
                         int64_t& out);
absl::Status ReadJsonDouble(const nlohmann::json& json, const char* key,
                            double& out);
absl::Status ReadJsonBool(const nlohmann::json& json, const char* key,
                          bool& out);
// INVALID_ARGUMENT "config.<field> ... <family> ..." when `set`.
absl::Status RefuseField(bool set, const char* field, const ModelFamily& family,
                         absl::string_view why);

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_MODEL_FAMILY_H_
