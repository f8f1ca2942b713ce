// libFuzzer target: untrusted config.json text through
// LlamaConfig::FromHfJson (runtime/config/llama_config.h), which reads the
// config.json of every checkpoint or HF directory a model is created from.
// (request_fuzzer reaches LlamaConfig only through the proto's int32
// fields.) An accepted config must be valid, already have its defaults
// filled, and survive ToHfJson -> FromHfJson unchanged.
//
//   build/tests/fuzz/fuzzers-build/config_fuzzer -runs=20000
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/config/llama_config.h"

namespace {

void Require(bool invariant) {
  if (!invariant) abort();
}

}  // namespace

// A regression input too large for the corpus: arrays nested deeper than
// dump() can recurse, where an error message quotes the value.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  constexpr size_t kDepth = 200000;
  const std::string deep = "{\"model_type\":" + std::string(kDepth, '[') +
                           std::string(kDepth, ']') + "}";
  Require(!tally::LlamaConfig::FromHfJson(deep).ok());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tally::LlamaConfig;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<LlamaConfig> config = LlamaConfig::FromHfJson(text);
  if (!config.ok()) {
    Require(config.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  Require(config->Validate().ok());
  Require(config->WithDefaults() == *config);
  Require(config->HeadDim() > 0 && config->HeadDim() % 2 == 0);
  // ModelInfo reports head_dim: it must be the one that runs.
  Require(config->head_dim == config->HeadDim());
  Require(config->NumParameters() > 0);
  absl::StatusOr<LlamaConfig> again =
      LlamaConfig::FromHfJson(config->ToHfJson("float32"));
  Require(again.ok() && *again == *config);
  return 0;
}
