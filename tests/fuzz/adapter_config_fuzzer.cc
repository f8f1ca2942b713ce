// libFuzzer target: untrusted adapter_config.json text through
// CheckPeftAdapterConfig (runtime/config/peft_adapter_config.h), which a LoRA
// model created with lora.init_adapter reads. Every outcome but OK is
// INVALID_ARGUMENT naming lora.init_adapter, with a short message.
//
//   build/tests/fuzz/fuzzers-build/adapter_config_fuzzer -runs=20000
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "runtime/config/lora_config.h"
#include "runtime/config/peft_adapter_config.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

tally::LoraConfig Lora() {
  tally::LoraConfig lora;
  lora.rank = 4;
  return lora.WithDefaults();
}

void CheckRefusal(const absl::Status& status) {
  using tally::fuzz::Require;
  Require(status.code() == absl::StatusCode::kInvalidArgument);
  Require(absl::StartsWith(status.message(), "lora.init_adapter adapter: "));
  Require(status.message().size() <= tally::fuzz::kMaxMessage);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::string deep = tally::fuzz::Nested(
      "{\"peft_type\":\"LORA\",\"r\":4,\"target_modules\":", "}", 300000);
  const absl::Status status =
      tally::CheckPeftAdapterConfig(deep, "adapter", Lora());
  tally::fuzz::Require(!status.ok());
  CheckRefusal(status);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const absl::Status status =
      tally::CheckPeftAdapterConfig(text, "adapter", Lora());
  if (!status.ok()) CheckRefusal(status);
  return 0;
}
