// HF "mistral" (MistralForCausalLM): Llama without biases, where every layer
// attends to the sliding_window latest positions (null: the whole prefix).
// HF's MistralConfig defaults sliding_window to 4096 when the file omits it.
#include "base/status.h"
#include "runtime/config/families/families.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/model_family.h"

namespace tally {

absl::Status ReadSlidingWindow(const nlohmann::json& json,
                               LlamaConfig& config) {
  if (json.contains("sliding_window") && json["sliding_window"].is_null()) {
    config.sliding_window = 0;
    return absl::OkStatus();
  }
  return ReadJsonInt(json, "sliding_window", config.sliding_window);
}

void WriteSlidingWindow(const LlamaConfig& config,
                        nlohmann::ordered_json& json) {
  json["sliding_window"] = config.sliding_window > 0
                               ? nlohmann::ordered_json(config.sliding_window)
                               : nlohmann::ordered_json(nullptr);
}

absl::Status ValidateNoBiasFamily(const LlamaConfig& config,
                                  const ModelFamily& family) {
  TALLY_RETURN_IF_ERROR(RefuseField(config.attention_bias, "attention_bias",
                                    family, "its projections have no bias"));
  TALLY_RETURN_IF_ERROR(RefuseField(config.mlp_bias, "mlp_bias", family,
                                    "its projections have no bias"));
  return RefuseField(config.max_window_layers != 0, "max_window_layers", family,
                     "the sliding window applies to every layer");
}

namespace {

class Mistral : public ModelFamily {
 public:
  const char* model_type() const override { return "mistral"; }
  const char* architecture() const override { return "MistralForCausalLM"; }

  void ApplyHfDefaults(LlamaConfig& config) const override {
    config.sliding_window = 4096;
  }
  absl::Status ReadHfFields(const nlohmann::json& json,
                            LlamaConfig& config) const override {
    return ReadSlidingWindow(json, config);
  }
  void WriteHfFields(const LlamaConfig& config,
                     nlohmann::ordered_json& json) const override {
    WriteSlidingWindow(config, json);
  }
  ModelFeatures Features(const LlamaConfig& config) const override {
    return {};
  }
  int64_t AttentionWindow(const LlamaConfig& config,
                          int64_t layer) const override {
    return config.sliding_window;
  }
  absl::Status Validate(const LlamaConfig& config) const override {
    TALLY_RETURN_IF_ERROR(RefuseField(config.is_moe(), "num_local_experts",
                                      *this, "use model_type mixtral"));
    return ValidateNoBiasFamily(config, *this);
  }
};

}  // namespace

const ModelFamily& MistralFamily() {
  static const Mistral family;
  return family;
}

}  // namespace tally
