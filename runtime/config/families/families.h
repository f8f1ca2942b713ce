// The supported model families (model_family.h), one file each. Only
// families/registry.cc, which lists them, and the family files include this
// header; everyone else finds a family through registry.h.
//
//   // runtime/config/families/registry.cc
//   &LlamaFamily(), &MistralFamily(), ...
//   // runtime/config/families/mistral.cc
//   absl::Status ReadHfFields(const nlohmann::json& json,
//                             LlamaConfig& config) const override {
//     return ReadSlidingWindow(json, config);
//   }
#ifndef TALLY_RUNTIME_CONFIG_FAMILIES_FAMILIES_H_
#define TALLY_RUNTIME_CONFIG_FAMILIES_FAMILIES_H_

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "runtime/config/model_family.h"

namespace tally {

const ModelFamily& LlamaFamily();
const ModelFamily& MistralFamily();
const ModelFamily& MixtralFamily();
const ModelFamily& Qwen2Family();
const ModelFamily& Qwen3Family();

// Shared by the families with HF's Mistral window field (mistral, mixtral):
// sliding_window (null: none) on every layer, and no biases.
absl::Status ReadSlidingWindow(const nlohmann::json& json, LlamaConfig& config);
void WriteSlidingWindow(const LlamaConfig& config,
                        nlohmann::ordered_json& json);
absl::Status ValidateNoBiasFamily(const LlamaConfig& config,
                                  const ModelFamily& family);

// Shared by the families with HF's Qwen2 window fields (qwen2, qwen3):
// use_sliding_window, sliding_window, max_window_layers and layer_types.
absl::Status ReadQwenWindow(const nlohmann::json& json, LlamaConfig& config);
void WriteQwenWindow(const LlamaConfig& config, nlohmann::ordered_json& json);
int64_t QwenAttentionWindow(const LlamaConfig& config, int64_t layer);

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_FAMILIES_FAMILIES_H_
