#include "runtime/config/lora_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace tally {

LoraConfig LoraConfig::WithDefaults() const {
  LoraConfig out = *this;
  if (out.alpha == 0) out.alpha = kDefaultLoraAlpha;
  return out;
}

bool SameAdapterShape(const LoraConfig& a, const LoraConfig& b) {
  return a.rank == b.rank && a.alpha == b.alpha &&
         LoraTargetModules(a) == LoraTargetModules(b);
}

absl::Status ValidateLoraConfig(const LoraConfig& lora) {
  if (lora.rank < 1 || lora.rank > kMaxLoraRank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lora.rank (", lora.rank, ") must be in [1, ", kMaxLoraRank, "]"));
  }
  if (!std::isfinite(lora.alpha) || lora.alpha <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lora.alpha (", lora.alpha,
                     ") must be finite and > 0 (0: ", kDefaultLoraAlpha, ")"));
  }
  if (!lora.train_attn && !lora.train_mlp && !lora.train_unembed) {
    return absl::InvalidArgumentError(
        "lora.train_attn, lora.train_mlp and lora.train_unembed are all "
        "false: the adapter would have nothing to train");
  }
  return absl::OkStatus();
}

absl::Status ValidateLoraForModel(const LlamaConfig& config,
                                  const LoraConfig& lora) {
  if (config.is_moe() && lora.train_mlp) {
    return absl::InvalidArgumentError(
        "lora.train_mlp is not implemented for mixture-of-experts models "
        "(their experts take no adapters yet); set it false");
  }
  return absl::OkStatus();
}

std::vector<std::string> LoraTargetModules(const LoraConfig& lora) {
  std::vector<std::string> modules;
  if (lora.train_attn) {
    modules.insert(modules.end(), {"q_proj", "k_proj", "v_proj", "o_proj"});
  }
  if (lora.train_mlp) {
    modules.insert(modules.end(), {"gate_proj", "up_proj", "down_proj"});
  }
  if (lora.train_unembed) modules.push_back("lm_head");
  return modules;
}

std::vector<LoraTarget> LoraLayerTargets(const LlamaConfig& config,
                                         const LoraConfig& lora) {
  const int64_t h = config.hidden_size, inter = config.intermediate_size;
  const int64_t q = config.num_attention_heads * config.HeadDim();
  const int64_t kv = config.num_key_value_heads * config.HeadDim();
  std::vector<LoraTarget> targets;
  if (lora.train_attn) {
    targets.push_back({"q_proj", "self_attn.q_proj", q, h});
    targets.push_back({"k_proj", "self_attn.k_proj", kv, h});
    targets.push_back({"v_proj", "self_attn.v_proj", kv, h});
    targets.push_back({"o_proj", "self_attn.o_proj", h, q});
  }
  if (lora.train_mlp && !config.is_moe()) {
    targets.push_back({"gate_proj", "mlp.gate_proj", inter, h});
    targets.push_back({"up_proj", "mlp.up_proj", inter, h});
    targets.push_back({"down_proj", "mlp.down_proj", h, inter});
  }
  return targets;
}

std::optional<LoraTarget> LoraUnembedTarget(const LlamaConfig& config,
                                            const LoraConfig& lora) {
  if (!lora.train_unembed) return std::nullopt;
  return LoraTarget{"lm_head", "lm_head", config.vocab_size,
                    config.hidden_size};
}

double LoraParameterCount(const LlamaConfig& config, const LoraConfig& lora) {
  if (!lora.enabled()) return 0;
  const double rank = static_cast<double>(lora.rank);
  double per_layer = 0;
  for (const LoraTarget& t : LoraLayerTargets(config, lora)) {
    per_layer += rank * (static_cast<double>(t.in_features) + t.out_features);
  }
  double count = per_layer * static_cast<double>(config.num_hidden_layers);
  if (auto head = LoraUnembedTarget(config, lora)) {
    count +=
        rank * (static_cast<double>(head->in_features) + head->out_features);
  }
  return count;
}

}  // namespace tally
