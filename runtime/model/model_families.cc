// The model families CreateCausalLm builds, by config.json's model_type. A
// new family adds its files and one entry here.
#include "absl/strings/str_cat.h"
#include "runtime/model/causal_lm.h"
#include "runtime/model/llama_model.h"

namespace tally {

absl::StatusOr<std::unique_ptr<CausalLm>> CreateCausalLm(
    const LlamaConfig& config, DType dtype, uint64_t seed,
    const ModelSharding& sharding, const ModelAdapters& adapters) {
  // "llama" and "mixtral" (a Llama whose MLPs are MoE blocks) today.
  absl::StatusOr<std::unique_ptr<LlamaModel>> llama =
      LlamaModel::Create(config, dtype, seed, sharding, adapters);
  if (!llama.ok()) return llama.status();
  return std::unique_ptr<CausalLm>(*std::move(llama));
}

}  // namespace tally
