#include "runtime/config/llama_config.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json_reader.h"
#include "base/status.h"
#include "runtime/config/families/registry.h"
#include "runtime/config/model_family.h"

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
  c.model_type = c.ResolvedModelType();
  // Left 0 when the heads do not divide hidden_size: Validate names that.
  if (c.head_dim == 0 && c.num_attention_heads > 0 &&
      c.hidden_size % c.num_attention_heads == 0) {
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.num_key_value_heads == 0) c.num_key_value_heads = c.num_attention_heads;
  if (c.rms_norm_eps == 0.0) c.rms_norm_eps = 1e-6;
  if (c.rope_theta == 0.0) c.rope_theta = 10000.0;
  if (c.max_position_embeddings == 0) c.max_position_embeddings = 2048;
  if (c.is_moe() && c.num_experts_per_tok == 0) c.num_experts_per_tok = 2;
  return c;
}

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
// The server's own bounds: a typo must not build thousands of layers.
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = 4096;

// The range of each integer field, WithDefaults() applied. ModelConfig
// carries every one as int32, so none may exceed it: ModelInfo then reports
// exactly what runs (docs/security.md, "Model config ranges").
struct IntRange {
  const char* field;
  int64_t LlamaConfig::*member;
  int64_t min;
  int64_t max;
};
constexpr IntRange kIntRanges[] = {
    {"vocab_size", &LlamaConfig::vocab_size, 1, kInt32Max},
    {"hidden_size", &LlamaConfig::hidden_size, 1, kInt32Max},
    {"intermediate_size", &LlamaConfig::intermediate_size, 1, kInt32Max},
    {"num_hidden_layers", &LlamaConfig::num_hidden_layers, 1, kMaxLayers},
    {"num_attention_heads", &LlamaConfig::num_attention_heads, 1, kInt32Max},
    {"num_key_value_heads", &LlamaConfig::num_key_value_heads, 1, kInt32Max},
    // 0 only where the heads do not divide hidden_size (refused below).
    {"head_dim", &LlamaConfig::head_dim, 0, kInt32Max},
    {"max_position_embeddings", &LlamaConfig::max_position_embeddings, 1,
     kInt32Max},
    {"sliding_window", &LlamaConfig::sliding_window, 0, kInt32Max},
    {"max_window_layers", &LlamaConfig::max_window_layers, 0, kInt32Max},
    {"num_local_experts", &LlamaConfig::num_local_experts, 0, kMaxExperts},
    {"num_experts_per_tok", &LlamaConfig::num_experts_per_tok, 0, kMaxExperts},
};

// Each floating-point field must be finite and > 0 (>= 0 where zero_allowed).
struct RealRange {
  const char* field;
  double LlamaConfig::*member;
  bool zero_allowed;
};
constexpr RealRange kRealRanges[] = {
    {"rms_norm_eps", &LlamaConfig::rms_norm_eps, false},
    {"rope_theta", &LlamaConfig::rope_theta, false},
    {"router_aux_loss_coef", &LlamaConfig::router_aux_loss_coef, true},
};

absl::Status CheckRealRange(const char* field, double value,
                            bool zero_allowed) {
  if (std::isfinite(value) && (value > 0.0 || (zero_allowed && value == 0.0))) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("config.", field, " must be finite and ",
                   zero_allowed ? ">= 0" : "> 0", ", got ", value));
}

absl::Status CheckRanges(const LlamaConfig& c) {
  for (const IntRange& range : kIntRanges) {
    const int64_t value = c.*range.member;
    if (value < range.min || value > range.max) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.", range.field, " must be in [", range.min, ", ",
                       range.max, "], got ", value));
    }
  }
  for (const RealRange& range : kRealRanges) {
    TALLY_RETURN_IF_ERROR(
        CheckRealRange(range.field, c.*range.member, range.zero_allowed));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LlamaConfig::Validate() const {
  TALLY_RETURN_IF_ERROR(CheckRanges(*this));
  if (head_dim == 0 && hidden_size % num_attention_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.num_attention_heads (", num_attention_heads,
                     ") must divide config.hidden_size (", hidden_size,
                     ") unless config.head_dim is given"));
  }
  if (HeadDim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.head_dim (", HeadDim(),
        ", default hidden_size / num_attention_heads) must be even for "
        "rotary embeddings"));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.num_key_value_heads (", num_key_value_heads,
                     ") must divide config.num_attention_heads (",
                     num_attention_heads, ")"));
  }
  TALLY_RETURN_IF_ERROR(ValidateRopeScaling(rope_scaling));
  if (is_moe() &&
      (num_experts_per_tok < 1 || num_experts_per_tok > num_local_experts)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.num_experts_per_tok must be in [1, num_local_experts = ",
        num_local_experts, "], got ", num_experts_per_tok));
  }
  if (!is_moe() && (num_experts_per_tok != 0 || router_aux_loss_coef != 0 ||
                    output_router_logits)) {
    return absl::InvalidArgumentError(
        "config.num_experts_per_tok, config.router_aux_loss_coef and "
        "config.output_router_logits need config.num_local_experts > 0");
  }
  TALLY_ASSIGN_OR_RETURN(const ModelFamily* family,
                         FindModelFamily(ResolvedModelType()));
  TALLY_RETURN_IF_ERROR(family->Validate(*this));
  // Keeps a typo from allocating terabytes: the largest matrix must fit.
  // Every size is in int32's range, so num_attention_heads * HeadDim() is
  // below 2^62.
  constexpr int64_t kMaxMatrixElements = int64_t{1} << 31;
  for (auto [field, rows] :
       {std::pair<const char*, int64_t>{"vocab_size", vocab_size},
        {"intermediate_size", intermediate_size},
        {"hidden_size", hidden_size},
        {"num_attention_heads * head_dim", num_attention_heads * HeadDim()}}) {
    if (rows > kMaxMatrixElements / hidden_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.", field, " (", rows, ") * config.hidden_size (",
                       hidden_size, ") is more than ", kMaxMatrixElements,
                       " elements in one matrix: too large for this server"));
    }
  }
  return absl::OkStatus();
}

uint64_t LlamaConfig::NumParameters() const {
  const uint64_t h = hidden_size, v = vocab_size, i = intermediate_size;
  const uint64_t d = HeadDim(), q = num_attention_heads * d,
                 kv = num_key_value_heads * d;
  ModelFeatures features;
  if (absl::StatusOr<const ModelFamily*> family =
          FindModelFamily(ResolvedModelType());
      family.ok()) {
    features = (*family)->Features(*this);
  }
  uint64_t attention = 2 * h * q + 2 * h * kv;
  if (features.qkv_bias) attention += q + 2 * kv;
  if (features.o_bias) attention += h;
  if (features.qk_norm) attention += 2 * d;
  // A MoE layer: the router [E, h] and E SwiGLU experts.
  uint64_t mlp = is_moe() ? num_local_experts * (h + 3 * h * i) : 3 * h * i;
  if (!is_moe() && features.mlp_bias) mlp += 2 * i + h;
  const uint64_t per_layer = attention + mlp + 2 * h;
  return v * h * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * per_layer +
         h;
}

absl::Status ValidateRopeScaling(const RopeScaling& r) {
  if (!r.rope_type.empty() && r.rope_type != "linear" &&
      r.rope_type != "llama3") {
    return absl::InvalidArgumentError(
        absl::StrCat("config.rope_scaling.rope_type \"", Excerpt(r.rope_type),
                     "\" is not implemented (tally implements \"\" for none, "
                     "default, linear, llama3)"));
  }
  // A parameter the type does not use must be 0: never dropped silently.
  const bool scaled = !r.rope_type.empty();
  const bool llama3 = r.rope_type == "llama3";
  auto unused = [&](const char* field) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.rope_scaling.", field, " does not apply to rope_type \"",
        scaled ? r.rope_type : "default", "\""));
  };
  for (auto [field, value, used] :
       {std::tuple<const char*, double, bool>{"factor", r.factor, scaled},
        {"low_freq_factor", r.low_freq_factor, llama3},
        {"high_freq_factor", r.high_freq_factor, llama3}}) {
    if (!used && value != 0.0) return unused(field);
    if (used && !(value > 0.0 && std::isfinite(value))) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.rope_scaling.", field,
                       " must be finite and > 0, got ", value));
    }
  }
  const int64_t original = r.original_max_position_embeddings;
  if (!llama3) {
    return original == 0 ? absl::OkStatus()
                         : unused("original_max_position_embeddings");
  }
  if (!(r.high_freq_factor > r.low_freq_factor)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.rope_scaling.high_freq_factor (", r.high_freq_factor,
        ") must exceed low_freq_factor (", r.low_freq_factor, ")"));
  }
  if (original < 1 || original > kInt32Max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.rope_scaling.original_max_position_embeddings must be in [1, ",
        kInt32Max, "], got ", original));
  }
  return absl::OkStatus();
}

namespace {

// rope_scaling's JSON form (null when there is none).
nlohmann::ordered_json RopeScalingJson(const RopeScaling& r) {
  if (r.rope_type.empty()) return nullptr;
  nlohmann::ordered_json j;
  j["rope_type"] = r.rope_type;
  j["factor"] = r.factor;
  if (r.rope_type == "llama3") {
    j["low_freq_factor"] = r.low_freq_factor;
    j["high_freq_factor"] = r.high_freq_factor;
    j["original_max_position_embeddings"] = r.original_max_position_embeddings;
  }
  return j;
}

// One RoPE object of config.json: `key` is "rope_scaling" (transformers 4)
// or "rope_parameters" (transformers 5, which also moves rope_theta into it).
absl::Status ReadRopeObject(const nlohmann::json& r, const char* key,
                            RopeScaling& out, double& rope_theta) {
  if (!r.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json ", key, " must be an object or null"));
  }
  TALLY_RETURN_IF_ERROR(ReadJsonDouble(r, "rope_theta", rope_theta));
  // transformers accepts the legacy "type" key for "rope_type".
  const char* type_key = r.contains("rope_type") ? "rope_type" : "type";
  if (!r.contains(type_key) || !r[type_key].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json ", key, ".rope_type must be a string"));
  }
  std::string type = r[type_key].get<std::string>();
  if (type == "default") return absl::OkStatus();
  // An unimplemented type is refused by Validate, naming it.
  out.rope_type = std::move(type);
  TALLY_RETURN_IF_ERROR(ReadJsonDouble(r, "factor", out.factor));
  // As in transformers, other types ignore the llama3 parameters.
  if (out.rope_type != "llama3") return absl::OkStatus();
  TALLY_RETURN_IF_ERROR(
      ReadJsonDouble(r, "low_freq_factor", out.low_freq_factor));
  TALLY_RETURN_IF_ERROR(
      ReadJsonDouble(r, "high_freq_factor", out.high_freq_factor));
  return ReadJsonInt(r, "original_max_position_embeddings",
                     out.original_max_position_embeddings);
}

// rope_theta and rope_scaling, or transformers 5's rope_parameters holding
// both (which wins when a file has both, as in transformers 5).
absl::Status ReadRope(const nlohmann::json& j, LlamaConfig& c) {
  TALLY_RETURN_IF_ERROR(ReadJsonDouble(j, "rope_theta", c.rope_theta));
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (j.contains(key) && !j[key].is_null()) {
      return ReadRopeObject(j[key], key, c.rope_scaling, c.rope_theta);
    }
  }
  return absl::OkStatus();
}

// partial_rotary_factor (top level, or in a RoPE object at `where`): RoPE on
// part of each head, which tally does not implement.
absl::Status RefusePartialRope(const nlohmann::json& j,
                               const std::string& where) {
  double partial = 1.0;
  TALLY_RETURN_IF_ERROR(ReadJsonDouble(j, "partial_rotary_factor", partial));
  if (partial == 1.0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("config.json ", where,
                   "partial_rotary_factor must be 1 (partial RoPE is not "
                   "implemented)"));
}

// Fields any family may carry that change the math and that tally does not
// implement: refused, never ignored.
absl::Status RefuseUnimplemented(const nlohmann::json& j) {
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    return absl::InvalidArgumentError(
        "config.json hidden_act must be \"silu\" (the only one implemented)");
  }
  if (j.contains("quantization_config") &&
      !j["quantization_config"].is_null()) {
    return absl::InvalidArgumentError(
        "config.json quantization_config: quantized checkpoints are not "
        "supported");
  }
  TALLY_RETURN_IF_ERROR(RefusePartialRope(j, ""));
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (j.contains(key) && j[key].is_object()) {
      TALLY_RETURN_IF_ERROR(RefusePartialRope(j[key], absl::StrCat(key, ".")));
    }
  }
  double dropout = 0.0;
  TALLY_RETURN_IF_ERROR(ReadJsonDouble(j, "attention_dropout", dropout));
  if (dropout != 0.0) {
    return absl::InvalidArgumentError(
        "config.json attention_dropout must be 0 (dropout is not "
        "implemented)");
  }
  return absl::OkStatus();
}

absl::Status ReadSharedFields(const nlohmann::json& j, LlamaConfig& c) {
  for (auto [key, field] :
       {std::pair<const char*, int64_t*>{"vocab_size", &c.vocab_size},
        {"hidden_size", &c.hidden_size},
        {"intermediate_size", &c.intermediate_size},
        {"num_hidden_layers", &c.num_hidden_layers},
        {"num_attention_heads", &c.num_attention_heads},
        {"num_key_value_heads", &c.num_key_value_heads},
        {"max_position_embeddings", &c.max_position_embeddings},
        {"head_dim", &c.head_dim}}) {
    TALLY_RETURN_IF_ERROR(ReadJsonInt(j, key, *field));
  }
  TALLY_RETURN_IF_ERROR(ReadJsonDouble(j, "rms_norm_eps", c.rms_norm_eps));
  TALLY_RETURN_IF_ERROR(
      ReadJsonBool(j, "tie_word_embeddings", c.tie_word_embeddings));
  return ReadRope(j, c);
}

}  // namespace

std::string LlamaConfig::ToHfJson(const std::string& dtype_name) const {
  const LlamaConfig c = WithDefaults();
  absl::StatusOr<const ModelFamily*> family = FindModelFamily(c.model_type);
  nlohmann::ordered_json j;
  j["architectures"] = {family.ok() ? (*family)->architecture() : ""};
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.HeadDim();
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_scaling"] = RopeScalingJson(c.rope_scaling);
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["attention_dropout"] = 0.0;
  if (family.ok()) (*family)->WriteHfFields(c, j);
  j["torch_dtype"] = dtype_name;
  return j.dump(2);
}

absl::StatusOr<LlamaConfig> LlamaConfig::FromHfJson(const std::string& text) {
  TALLY_ASSIGN_OR_RETURN(nlohmann::json j,
                         ParseJson(text, kConfigJsonLimits, "config.json",
                                   absl::StatusCode::kInvalidArgument));
  if (!j.is_object()) {
    return absl::InvalidArgumentError("config.json is not a JSON object");
  }
  if (!j.contains("model_type") || !j["model_type"].is_string()) {
    return absl::InvalidArgumentError(
        "config.json model_type must be a string (e.g. \"llama\")");
  }
  LlamaConfig c;
  c.model_type = j["model_type"].get<std::string>();
  absl::StatusOr<const ModelFamily*> family = FindModelFamily(c.model_type);
  if (!family.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json model_type \"", Excerpt(c.model_type),
                     "\" is not supported (tally loads ",
                     absl::StrJoin(SupportedModelTypes(), ", "), ")"));
  }
  TALLY_RETURN_IF_ERROR(RefuseUnimplemented(j));
  (*family)->ApplyHfDefaults(c);
  TALLY_RETURN_IF_ERROR(ReadSharedFields(j, c));
  TALLY_RETURN_IF_ERROR((*family)->ReadHfFields(j, c));
  c = c.WithDefaults();
  if (absl::Status s = c.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: ", s.message()));
  }
  return c;
}

bool RopeScaling::operator==(const RopeScaling& o) const {
  return rope_type == o.rope_type && factor == o.factor &&
         low_freq_factor == o.low_freq_factor &&
         high_freq_factor == o.high_freq_factor &&
         original_max_position_embeddings == o.original_max_position_embeddings;
}

bool LlamaConfig::operator==(const LlamaConfig& o) const {
  return model_type == o.model_type && vocab_size == o.vocab_size &&
         hidden_size == o.hidden_size &&
         intermediate_size == o.intermediate_size &&
         num_hidden_layers == o.num_hidden_layers &&
         num_attention_heads == o.num_attention_heads &&
         num_key_value_heads == o.num_key_value_heads &&
         rms_norm_eps == o.rms_norm_eps && rope_theta == o.rope_theta &&
         max_position_embeddings == o.max_position_embeddings &&
         tie_word_embeddings == o.tie_word_embeddings &&
         num_local_experts == o.num_local_experts &&
         num_experts_per_tok == o.num_experts_per_tok &&
         router_aux_loss_coef == o.router_aux_loss_coef &&
         output_router_logits == o.output_router_logits &&
         head_dim == o.head_dim && attention_bias == o.attention_bias &&
         mlp_bias == o.mlp_bias && rope_scaling == o.rope_scaling &&
         sliding_window == o.sliding_window &&
         max_window_layers == o.max_window_layers;
}

}  // namespace tally
