// LlamaConfig: the architecture hyperparameters of a tally model, under the
// HF LlamaConfig field names so config.json moves between tally and HF. With
// num_local_experts > 0 the model is a Mixtral-style mixture of experts (HF
// MixtralConfig names; config.json "model_type": "mixtral").
//
//   tally::LlamaConfig config = tally::LlamaConfig::EmbeddedDefault();
//   TALLY_RETURN_IF_ERROR(config.Validate());
//   std::string json = config.ToHfJson("float32");
#ifndef TALLY_RUNTIME_LLAMA_CONFIG_H_
#define TALLY_RUNTIME_LLAMA_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tally {

struct LlamaConfig {
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
  // Mixture of experts: every layer's MLP is a block_sparse_moe of this many
  // SwiGLU experts (0: the dense Llama MLP), each token routed to the top
  // num_experts_per_tok (0: 2) of them.
  int64_t num_local_experts = 0;
  int64_t num_experts_per_tok = 0;
  // Weight of the load-balancing loss added to the training loss (0: none,
  // HF's default behaviour, where it needs output_router_logits).
  double router_aux_loss_coef = 0.0;

  bool is_moe() const { return num_local_experts > 0; }

  // The built-in demo model: byte-level vocabulary (256 bytes + specials).
  static LlamaConfig EmbeddedDefault();

  // Fills fields left at 0 with the HF defaults.
  LlamaConfig WithDefaults() const;

  // INVALID_ARGUMENT naming the field (`config.<field>`) for a config that
  // cannot build a model. Expects WithDefaults() applied.
  absl::Status Validate() const;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  uint64_t NumParameters() const;

  // HF config.json ("model_type": "llama" or "mixtral", "torch_dtype":
  // dtype_name).
  std::string ToHfJson(const std::string& dtype_name) const;
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

#endif  // TALLY_RUNTIME_LLAMA_CONFIG_H_
