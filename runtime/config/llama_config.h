// LlamaConfig: the architecture hyperparameters of a tally model, under the
// HF config field names so config.json moves between tally and HF. One
// struct serves every supported family (model_family.h: llama, mistral,
// mixtral, qwen2, qwen3), as they share Llama's decoder; model_type says
// which family's fields and features apply. With num_local_experts > 0 the
// model is a Mixtral-style mixture of experts.
//
//   tally::LlamaConfig config = tally::LlamaConfig::EmbeddedDefault();
//   TALLY_RETURN_IF_ERROR(config.Validate());
//   std::string json = config.ToHfJson("float32");
#ifndef TALLY_RUNTIME_CONFIG_LLAMA_CONFIG_H_
#define TALLY_RUNTIME_CONFIG_LLAMA_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tally {

// HF "rope_scaling": how RoPE's frequencies are rescaled for long context.
struct RopeScaling {
  // "" (none, HF "default"), "linear" (positions / factor) or "llama3"
  // (transformers' _compute_llama3_parameters).
  std::string rope_type;
  double factor = 0.0;
  double low_freq_factor = 0.0;                  // llama3
  double high_freq_factor = 0.0;                 // llama3
  int64_t original_max_position_embeddings = 0;  // llama3

  bool operator==(const RopeScaling& other) const;
};

// INVALID_ARGUMENT naming config.rope_scaling.<field> for a type tally does
// not implement, a parameter out of range, or one the type does not use.
absl::Status ValidateRopeScaling(const RopeScaling& rope_scaling);

struct LlamaConfig {
  // HF config.json "model_type" (model_family.h). Empty: "mixtral" with
  // num_local_experts > 0, else "llama".
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;      // 0: = num_attention_heads
  double rms_norm_eps = 0.0;            // 0: 1e-6
  double rope_theta = 0.0;              // 0: 10000
  int64_t max_position_embeddings = 0;  // 0: 2048
  bool tie_word_embeddings = false;
  int64_t head_dim = 0;  // 0: hidden_size / num_attention_heads
  // What each family makes of these: ModelFamily::Features.
  bool attention_bias = false;
  bool mlp_bias = false;
  RopeScaling rope_scaling;
  // 0: none. The layers a family applies it to see only the sliding_window
  // latest positions (ModelFamily::AttentionWindow).
  int64_t sliding_window = 0;
  // qwen2, qwen3: layers [0, max_window_layers) attend to the whole prefix.
  int64_t max_window_layers = 0;
  // Mixture of experts: every layer's MLP is a block_sparse_moe of this many
  // SwiGLU experts (0: the dense Llama MLP), each token routed to the top
  // num_experts_per_tok (0: 2) of them.
  int64_t num_local_experts = 0;
  int64_t num_experts_per_tok = 0;
  // Weight of HF's load-balancing loss in the training loss; as in HF it
  // applies only when output_router_logits is true.
  double router_aux_loss_coef = 0.0;
  bool output_router_logits = false;

  bool is_moe() const { return num_local_experts > 0; }
  // The coefficient the training loss uses (0: no load-balancing loss).
  double load_balancing_coefficient() const {
    return output_router_logits ? router_aux_loss_coef : 0.0;
  }

  // The built-in demo model: byte-level vocabulary (256 bytes + specials).
  static LlamaConfig EmbeddedDefault();

  // Fills fields left at 0 with the HF defaults.
  LlamaConfig WithDefaults() const;

  // INVALID_ARGUMENT naming the field (`config.<field>`) for a value out of
  // its range (docs/security.md, "Model config ranges": every integer within
  // int32, as ModelConfig reports it) or a config that cannot build a model,
  // including fields its family does not have. Expects WithDefaults()
  // applied.
  absl::Status Validate() const;

  // model_type, or the default WithDefaults() gives it.
  std::string ResolvedModelType() const {
    if (!model_type.empty()) return model_type;
    return is_moe() ? "mixtral" : "llama";
  }
  int64_t HeadDim() const {
    return head_dim > 0 ? head_dim : hidden_size / num_attention_heads;
  }
  uint64_t NumParameters() const;

  // HF config.json of the family ("torch_dtype": dtype_name), with every
  // field its transformers config class reads.
  std::string ToHfJson(const std::string& dtype_name) const;
  // Any supported family's config.json. A field that changes the math and
  // is not implemented is INVALID_ARGUMENT naming it, never ignored; so is
  // text beyond kConfigJsonLimits (base/json_reader.h: its size, nesting).
  static absl::StatusOr<LlamaConfig> FromHfJson(const std::string& json);

  bool operator==(const LlamaConfig& other) const;
  bool operator!=(const LlamaConfig& other) const { return !(*this == other); }
};

// Byte-level tokens of the embedded default vocabulary.
inline constexpr int32_t kByteVocab = 256;
inline constexpr int32_t kBosToken = 256;
inline constexpr int32_t kEosToken = 257;
inline constexpr int32_t kPadToken = 258;

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_LLAMA_CONFIG_H_
