#include "runtime/llama_config.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace tally {

LlamaConfig LlamaConfig::EmbeddedDefault() {
  LlamaConfig config;
  config.vocab_size = 260;  // 256 bytes + BOS, EOS, PAD, one spare
  config.hidden_size = 128;
  config.intermediate_size = 352;
  config.num_hidden_layers = 4;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.rms_norm_eps = 1e-5;
  config.rope_theta = 10000.0;
  config.max_position_embeddings = 512;
  config.tie_word_embeddings = false;
  return config;
}

LlamaConfig LlamaConfig::WithDefaults() const {
  LlamaConfig c = *this;
  if (c.num_key_value_heads == 0) c.num_key_value_heads = c.num_attention_heads;
  if (c.rms_norm_eps == 0.0) c.rms_norm_eps = 1e-6;
  if (c.rope_theta == 0.0) c.rope_theta = 10000.0;
  if (c.max_position_embeddings == 0) c.max_position_embeddings = 2048;
  if (c.is_moe() && c.num_experts_per_tok == 0) c.num_experts_per_tok = 2;
  return c;
}

absl::Status LlamaConfig::Validate() const {
  auto positive = [](const char* field, int64_t value) -> absl::Status {
    if (value > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("config.", field, " must be > 0, got ", value));
  };
  for (auto [field, value] :
       {std::pair<const char*, int64_t>{"vocab_size", vocab_size},
        {"hidden_size", hidden_size},
        {"intermediate_size", intermediate_size},
        {"num_hidden_layers", num_hidden_layers},
        {"num_attention_heads", num_attention_heads},
        {"num_key_value_heads", num_key_value_heads},
        {"max_position_embeddings", max_position_embeddings}}) {
    if (absl::Status s = positive(field, value); !s.ok()) return s;
  }
  if (hidden_size % num_attention_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.num_attention_heads (", num_attention_heads,
                     ") must divide config.hidden_size (", hidden_size, ")"));
  }
  if (head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.hidden_size / config.num_attention_heads (",
                     head_dim(), ") must be even for rotary embeddings"));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.num_key_value_heads (", num_key_value_heads,
                     ") must divide config.num_attention_heads (",
                     num_attention_heads, ")"));
  }
  if (!(rms_norm_eps > 0.0) || !std::isfinite(rms_norm_eps)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.rms_norm_eps must be finite and > 0, got ", rms_norm_eps));
  }
  if (!(rope_theta > 0.0) || !std::isfinite(rope_theta)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.rope_theta must be finite and > 0, got ", rope_theta));
  }
  if (num_local_experts < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.num_local_experts must be >= 0, got ", num_local_experts));
  }
  if (is_moe() &&
      (num_experts_per_tok < 1 || num_experts_per_tok > num_local_experts)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.num_experts_per_tok must be in [1, num_local_experts = ",
        num_local_experts, "], got ", num_experts_per_tok));
  }
  if (!is_moe() && (num_experts_per_tok != 0 || router_aux_loss_coef != 0)) {
    return absl::InvalidArgumentError(
        "config.num_experts_per_tok and config.router_aux_loss_coef need "
        "config.num_local_experts > 0");
  }
  if (!(router_aux_loss_coef >= 0.0) || !std::isfinite(router_aux_loss_coef)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.router_aux_loss_coef must be finite and >= 0, got ",
        router_aux_loss_coef));
  }
  // Keeps a typo from allocating terabytes: the largest matrix must fit.
  // Divided, not multiplied: config.json sizes can overflow int64.
  constexpr int64_t kMaxMatrixElements = int64_t{1} << 31;
  auto too_large = [&](int64_t rows) {
    return rows > kMaxMatrixElements / hidden_size;
  };
  if (too_large(vocab_size) || too_large(intermediate_size) ||
      too_large(hidden_size) || num_hidden_layers > 4096 ||
      num_local_experts > 4096) {
    return absl::InvalidArgumentError(
        "config describes a model too large for this server");
  }
  return absl::OkStatus();
}

uint64_t LlamaConfig::NumParameters() const {
  const uint64_t h = hidden_size, v = vocab_size, i = intermediate_size;
  const uint64_t kv = num_key_value_heads * head_dim();
  // A MoE layer: the router [E, h] and E SwiGLU experts.
  const uint64_t mlp =
      is_moe() ? num_local_experts * (h + 3 * h * i) : 3 * h * i;
  const uint64_t per_layer = h * h * 2 + h * kv * 2 + mlp + 2 * h;
  return v * h * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * per_layer +
         h;
}

std::string LlamaConfig::ToHfJson(const std::string& dtype_name) const {
  nlohmann::ordered_json j;
  j["architectures"] = {is_moe() ? "MixtralForCausalLM" : "LlamaForCausalLM"};
  j["model_type"] = is_moe() ? "mixtral" : "llama";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["max_position_embeddings"] = max_position_embeddings;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  if (is_moe()) {
    j["num_local_experts"] = num_local_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["output_router_logits"] = router_aux_loss_coef > 0;
  }
  j["torch_dtype"] = dtype_name;
  return j.dump(2);
}

absl::StatusOr<LlamaConfig> LlamaConfig::FromHfJson(const std::string& text) {
  nlohmann::json j =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json is not a JSON object");
  }
  // A value for an error message: dump() recurses, and a hostile file may
  // nest arrays deeper than the stack allows.
  auto describe = [](const nlohmann::json& value) -> std::string {
    if (value.is_array()) return "an array";
    if (value.is_object()) return "an object";
    return value.dump();
  };
  const bool mixtral = j.contains("model_type") && j["model_type"] == "mixtral";
  if (j.contains("model_type") && j["model_type"] != "llama" && !mixtral) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json model_type is ", describe(j["model_type"]),
                     "; tally loads llama and mixtral models"));
  }
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    return absl::InvalidArgumentError(absl::StrCat("config.json hidden_act is ",
                                                   describe(j["hidden_act"]),
                                                   "; tally implements silu"));
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    return absl::InvalidArgumentError(
        "config.json rope_scaling is not supported");
  }
  LlamaConfig c;
  if (mixtral) c.num_local_experts = 8;  // HF MixtralConfig's default
  auto read_int = [&](const char* key, int64_t& out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    if (!j[key].is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json ", key, " must be an integer"));
    }
    out = j[key].get<int64_t>();
    return absl::OkStatus();
  };
  auto read_double = [&](const char* key, double& out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    if (!j[key].is_number()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json ", key, " must be a number"));
    }
    out = j[key].get<double>();
    return absl::OkStatus();
  };
  for (auto [key, field] :
       {std::pair<const char*, int64_t*>{"vocab_size", &c.vocab_size},
        {"hidden_size", &c.hidden_size},
        {"intermediate_size", &c.intermediate_size},
        {"num_hidden_layers", &c.num_hidden_layers},
        {"num_attention_heads", &c.num_attention_heads},
        {"num_key_value_heads", &c.num_key_value_heads},
        {"max_position_embeddings", &c.max_position_embeddings}}) {
    if (absl::Status s = read_int(key, *field); !s.ok()) return s;
  }
  if (mixtral) {
    for (auto [key, field] :
         {std::pair<const char*, int64_t*>{"num_local_experts",
                                           &c.num_local_experts},
          {"num_experts_per_tok", &c.num_experts_per_tok}}) {
      if (absl::Status s = read_int(key, *field); !s.ok()) return s;
    }
    if (!j.contains("output_router_logits") ||
        j["output_router_logits"] == true) {
      if (absl::Status s =
              read_double("router_aux_loss_coef", c.router_aux_loss_coef);
          !s.ok()) {
        return s;
      }
    }
    if (!c.is_moe()) {
      return absl::InvalidArgumentError(
          "config.json num_local_experts must be > 0 for a mixtral model");
    }
  }
  if (absl::Status s = read_double("rms_norm_eps", c.rms_norm_eps); !s.ok()) {
    return s;
  }
  if (absl::Status s = read_double("rope_theta", c.rope_theta); !s.ok()) {
    return s;
  }
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean()) {
      return absl::InvalidArgumentError(
          "config.json tie_word_embeddings must be a boolean");
    }
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  c = c.WithDefaults();
  if (absl::Status s = c.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: ", s.message()));
  }
  return c;
}

bool LlamaConfig::operator==(const LlamaConfig& o) const {
  return vocab_size == o.vocab_size && hidden_size == o.hidden_size &&
         intermediate_size == o.intermediate_size &&
         num_hidden_layers == o.num_hidden_layers &&
         num_attention_heads == o.num_attention_heads &&
         num_key_value_heads == o.num_key_value_heads &&
         rms_norm_eps == o.rms_norm_eps && rope_theta == o.rope_theta &&
         max_position_embeddings == o.max_position_embeddings &&
         tie_word_embeddings == o.tie_word_embeddings &&
         num_local_experts == o.num_local_experts &&
         num_experts_per_tok == o.num_experts_per_tok &&
         router_aux_loss_coef == o.router_aux_loss_coef;
}

}  // namespace tally
