// ReadAdapter: the LoRA factors a model starts from (ModelSpec's
// lora.init_adapter), read from a PEFT adapter directory or from a tally
// checkpoint of an adapter. Apart from lora.h because it reads checkpoints
// (checkpoint.h), which hold models (causal_lm.h), which hold LoRA factors:
// lora.h stays below the model, this reader above the checkpoint.
//
//   TALLY_ASSIGN_OR_RETURN(
//       tally::NamedTensors factors,
//       tally::ReadAdapter(spec.lora.init_adapter, spec.config, spec.lora));
#ifndef TALLY_RUNTIME_CHECKPOINT_LORA_ADAPTER_READER_H_
#define TALLY_RUNTIME_CHECKPOINT_LORA_ADAPTER_READER_H_

#include <string>

#include "absl/status/statusor.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/lora_config.h"
#include "runtime/io/safetensors.h"

namespace tally {

// The adapter factors a LoRA model starts from: a PEFT adapter directory
// (adapter_config.json + adapter_model.safetensors) or a tally checkpoint of
// an adapter (tally.json with its lora section), under tally's parameter
// names. INVALID_ARGUMENT naming "lora.init_adapter" and what differs when
// its rank, alpha or target modules are not `lora`'s (CheckPeftAdapterConfig,
// runtime/config/peft_adapter_config.h), or it holds anything but the LoRA
// factors of the model `config` describes, in their shapes (refused before any
// is allocated); NOT_FOUND for a missing directory.
absl::StatusOr<NamedTensors> ReadAdapter(const std::string& dir,
                                         const LlamaConfig& config,
                                         const LoraConfig& lora);

}  // namespace tally

#endif  // TALLY_RUNTIME_CHECKPOINT_LORA_ADAPTER_READER_H_
