// The adapter_config.json of a PEFT LoRA adapter directory, checked against
// the adapter a model asks for (lora.init_adapter). Torch-free, so the
// parser of this untrusted file is fuzzed on its own
// (tests/fuzz/adapter_config_fuzzer.cc); runtime/model/lora.h reads the
// factors.
//
//   TALLY_RETURN_IF_ERROR(tally::CheckPeftAdapterConfig(text, dir, lora));
#ifndef TALLY_RUNTIME_CONFIG_PEFT_ADAPTER_CONFIG_H_
#define TALLY_RUNTIME_CONFIG_PEFT_ADAPTER_CONFIG_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "runtime/config/lora_config.h"

namespace tally {

// INVALID_ARGUMENT "lora.init_adapter <dir>: <what>".
absl::Status InitAdapterError(const std::string& dir, absl::string_view what);

// Checks `text`, the adapter_config.json of the PEFT adapter directory
// `dir`: INVALID_ARGUMENT naming lora.init_adapter, the file and the field
// for text beyond kConfigJsonLimits (base/json_reader.h), a field of the
// wrong type, an option tally does not implement (rslora, dora, per-module
// patterns, ...), or a rank, alpha or target_modules that are not `lora`'s.
absl::Status CheckPeftAdapterConfig(absl::string_view text,
                                    const std::string& dir,
                                    const LoraConfig& lora);

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_PEFT_ADAPTER_CONFIG_H_
