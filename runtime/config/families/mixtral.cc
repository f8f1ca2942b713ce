// HF "mixtral" (MixtralForCausalLM): Mistral whose MLPs are sparse MoE blocks
// (moe_block.h). Its load-balancing loss counts only with
// output_router_logits, as in HF; router_jitter_noise (training-time noise)
// is not implemented and refused unless 0.
#include "base/status.h"
#include "runtime/config/families/families.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/model_family.h"

namespace tally {
namespace {

class Mixtral : public ModelFamily {
 public:
  const char* model_type() const override { return "mixtral"; }
  const char* architecture() const override { return "MixtralForCausalLM"; }

  void ApplyHfDefaults(LlamaConfig& config) const override {
    // transformers' MixtralConfig defaults.
    config.rms_norm_eps = 1e-5;
    config.rope_theta = 1e6;
    config.num_local_experts = 8;
    config.num_experts_per_tok = 2;
    config.router_aux_loss_coef = 0.001;
  }

  absl::Status ReadHfFields(const nlohmann::json& json,
                            LlamaConfig& config) const override {
    double jitter = 0.0;
    TALLY_RETURN_IF_ERROR(ReadJsonDouble(json, "router_jitter_noise", jitter));
    if (jitter != 0.0) {
      return absl::InvalidArgumentError(
          "config.json router_jitter_noise must be 0 (router noise is not "
          "implemented)");
    }
    TALLY_RETURN_IF_ERROR(
        ReadJsonInt(json, "num_local_experts", config.num_local_experts));
    TALLY_RETURN_IF_ERROR(
        ReadJsonInt(json, "num_experts_per_tok", config.num_experts_per_tok));
    TALLY_RETURN_IF_ERROR(ReadJsonDouble(json, "router_aux_loss_coef",
                                         config.router_aux_loss_coef));
    TALLY_RETURN_IF_ERROR(ReadJsonBool(json, "output_router_logits",
                                       config.output_router_logits));
    if (!config.is_moe()) {
      return absl::InvalidArgumentError(
          "config.json num_local_experts must be > 0 for a mixtral model");
    }
    return ReadSlidingWindow(json, config);
  }

  void WriteHfFields(const LlamaConfig& config,
                     nlohmann::ordered_json& json) const override {
    json["num_local_experts"] = config.num_local_experts;
    json["num_experts_per_tok"] = config.num_experts_per_tok;
    json["router_aux_loss_coef"] = config.router_aux_loss_coef;
    json["output_router_logits"] = config.output_router_logits;
    json["router_jitter_noise"] = 0.0;
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
    TALLY_RETURN_IF_ERROR(RefuseField(!config.is_moe(), "num_local_experts",
                                      *this, "a mixtral model needs experts"));
    return ValidateNoBiasFamily(config, *this);
  }
};

}  // namespace

const ModelFamily& MixtralFamily() {
  static const Mixtral family;
  return family;
}

}  // namespace tally
