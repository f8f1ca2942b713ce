// HF "qwen2" (Qwen2ForCausalLM, Qwen2 and Qwen2.5): Llama with a bias on q, k
// and v (not o). With use_sliding_window, the layers from max_window_layers
// on (or those layer_types marks "sliding_attention") attend to the
// sliding_window latest positions.
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/config/families/families.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/model_family.h"

namespace tally {
namespace {

// layer_types as max_window_layers: full-attention layers first, then
// sliding ones (the only layout Qwen2's config produces).
absl::Status ReadLayerTypes(const nlohmann::json& json, LlamaConfig& config) {
  if (!json.contains("layer_types") || json["layer_types"].is_null()) {
    return absl::OkStatus();
  }
  const nlohmann::json& types = json["layer_types"];
  if (!types.is_array() ||
      static_cast<int64_t>(types.size()) != config.num_hidden_layers) {
    return absl::InvalidArgumentError(
        "config.json layer_types must list num_hidden_layers entries");
  }
  int64_t first_sliding = config.num_hidden_layers;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const bool sliding = types[i] == "sliding_attention";
    if (!sliding && types[i] != "full_attention") {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json layer_types[", i,
          "] must be \"full_attention\" or \"sliding_attention\""));
    }
    if (sliding && first_sliding == config.num_hidden_layers) first_sliding = i;
    if (!sliding && i > first_sliding) {
      return absl::InvalidArgumentError(
          "config.json layer_types: a full_attention layer after a "
          "sliding_attention one is not implemented");
    }
  }
  // layer_types decides, as in transformers: without a sliding layer no
  // layer slides, whatever use_sliding_window and max_window_layers say.
  if (first_sliding < config.num_hidden_layers) {
    config.max_window_layers = first_sliding;
  } else {
    config.sliding_window = 0;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadQwenWindow(const nlohmann::json& json, LlamaConfig& config) {
  bool use_sliding_window = false;
  TALLY_RETURN_IF_ERROR(
      ReadJsonBool(json, "use_sliding_window", use_sliding_window));
  int64_t window = 4096;  // Qwen2Config's default
  if (json.contains("sliding_window") && json["sliding_window"].is_null()) {
    window = 0;
  } else {
    TALLY_RETURN_IF_ERROR(ReadJsonInt(json, "sliding_window", window));
  }
  config.sliding_window = use_sliding_window ? window : 0;
  TALLY_RETURN_IF_ERROR(
      ReadJsonInt(json, "max_window_layers", config.max_window_layers));
  return ReadLayerTypes(json, config);
}

void WriteQwenWindow(const LlamaConfig& config, nlohmann::ordered_json& json) {
  json["use_sliding_window"] = config.sliding_window > 0;
  json["sliding_window"] = config.sliding_window > 0
                               ? nlohmann::ordered_json(config.sliding_window)
                               : nlohmann::ordered_json(nullptr);
  json["max_window_layers"] = config.max_window_layers;
}

int64_t QwenAttentionWindow(const LlamaConfig& config, int64_t layer) {
  return layer >= config.max_window_layers ? config.sliding_window : 0;
}

namespace {

class Qwen2 : public ModelFamily {
 public:
  const char* model_type() const override { return "qwen2"; }
  const char* architecture() const override { return "Qwen2ForCausalLM"; }

  void ApplyHfDefaults(LlamaConfig& config) const override {
    config.max_window_layers = 28;  // Qwen2Config's default
  }
  absl::Status ReadHfFields(const nlohmann::json& json,
                            LlamaConfig& config) const override {
    bool mrope = false;
    TALLY_RETURN_IF_ERROR(ReadJsonBool(json, "use_mrope", mrope));
    if (mrope) {
      return absl::InvalidArgumentError(
          "config.json use_mrope (multimodal RoPE) is not implemented");
    }
    return ReadQwenWindow(json, config);
  }
  void WriteHfFields(const LlamaConfig& config,
                     nlohmann::ordered_json& json) const override {
    WriteQwenWindow(config, json);
  }
  ModelFeatures Features(const LlamaConfig& config) const override {
    ModelFeatures features;
    features.qkv_bias = true;
    return features;
  }
  int64_t AttentionWindow(const LlamaConfig& config,
                          int64_t layer) const override {
    return QwenAttentionWindow(config, layer);
  }
  absl::Status Validate(const LlamaConfig& config) const override {
    TALLY_RETURN_IF_ERROR(RefuseField(config.is_moe(), "num_local_experts",
                                      *this, "it has dense MLPs"));
    TALLY_RETURN_IF_ERROR(RefuseField(
        config.attention_bias, "attention_bias", *this,
        "its q, k and v projections always have a bias and o never"));
    return RefuseField(config.mlp_bias, "mlp_bias", *this,
                       "its MLP has no bias");
  }
};

}  // namespace

const ModelFamily& Qwen2Family() {
  static const Qwen2 family;
  return family;
}

}  // namespace tally
