// HF "llama" (LlamaForCausalLM, Llama 2 and 3.x): attention_bias puts a bias
// on q, k, v and o; mlp_bias on gate, up and down. No sliding window.
#include "base/status.h"
#include "runtime/config/families/families.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/model_family.h"

namespace tally {
namespace {

class Llama : public ModelFamily {
 public:
  const char* model_type() const override { return "llama"; }
  const char* architecture() const override { return "LlamaForCausalLM"; }

  absl::Status ReadHfFields(const nlohmann::json& json,
                            LlamaConfig& config) const override {
    TALLY_RETURN_IF_ERROR(
        ReadJsonBool(json, "attention_bias", config.attention_bias));
    return ReadJsonBool(json, "mlp_bias", config.mlp_bias);
  }

  void WriteHfFields(const LlamaConfig& config,
                     nlohmann::ordered_json& json) const override {
    json["attention_bias"] = config.attention_bias;
    json["mlp_bias"] = config.mlp_bias;
  }

  ModelFeatures Features(const LlamaConfig& config) const override {
    ModelFeatures features;
    features.qkv_bias = features.o_bias = config.attention_bias;
    features.mlp_bias = config.mlp_bias;
    return features;
  }

  absl::Status Validate(const LlamaConfig& config) const override {
    TALLY_RETURN_IF_ERROR(RefuseField(config.is_moe(), "num_local_experts",
                                      *this, "use model_type mixtral"));
    TALLY_RETURN_IF_ERROR(RefuseField(config.sliding_window != 0,
                                      "sliding_window", *this,
                                      "Llama attends to the whole prefix"));
    return RefuseField(config.max_window_layers != 0, "max_window_layers",
                       *this, "Llama has no sliding window");
  }
};

}  // namespace

const ModelFamily& LlamaFamily() {
  static const Llama family;
  return family;
}

}  // namespace tally
