// HF "qwen3" (Qwen3ForCausalLM): Llama with per-head RMSNorms of queries and
// keys over head_dim before RoPE (self_attn.q_norm / k_norm), an explicit
// head_dim (Qwen3Config's default 128) and Qwen2's sliding-window fields;
// attention_bias as Llama's.
#include "base/status.h"
#include "runtime/config/families/families.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/model_family.h"

namespace tally {
namespace {

class Qwen3 : public ModelFamily {
 public:
  const char* model_type() const override { return "qwen3"; }
  const char* architecture() const override { return "Qwen3ForCausalLM"; }

  void ApplyHfDefaults(LlamaConfig& config) const override {
    config.head_dim = 128;
    config.max_window_layers = 28;
  }
  absl::Status ReadHfFields(const nlohmann::json& json,
                            LlamaConfig& config) const override {
    TALLY_RETURN_IF_ERROR(
        ReadJsonBool(json, "attention_bias", config.attention_bias));
    return ReadQwenWindow(json, config);
  }
  void WriteHfFields(const LlamaConfig& config,
                     nlohmann::ordered_json& json) const override {
    json["attention_bias"] = config.attention_bias;
    WriteQwenWindow(config, json);
  }
  ModelFeatures Features(const LlamaConfig& config) const override {
    ModelFeatures features;
    features.qkv_bias = features.o_bias = config.attention_bias;
    features.qk_norm = true;
    return features;
  }
  int64_t AttentionWindow(const LlamaConfig& config,
                          int64_t layer) const override {
    return QwenAttentionWindow(config, layer);
  }
  absl::Status Validate(const LlamaConfig& config) const override {
    TALLY_RETURN_IF_ERROR(RefuseField(config.is_moe(), "num_local_experts",
                                      *this,
                                      "qwen3_moe is not implemented yet"));
    return RefuseField(config.mlp_bias, "mlp_bias", *this,
                       "its MLP has no bias");
  }
};

}  // namespace

const ModelFamily& Qwen3Family() {
  static const Qwen3 family;
  return family;
}

}  // namespace tally
