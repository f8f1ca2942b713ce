#include "runtime/checkpoint/lora_adapter_reader.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/file_text.h"
#include "base/json_reader.h"
#include "base/status.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/expected_tensors.h"
#include "runtime/config/peft_adapter_config.h"
#include "runtime/model/lora.h"

namespace tally {
namespace {

// The factors of a PEFT adapter directory after checking its config
// against `lora` and, before reading them, their names and shapes against
// the adapters of the model `config` describes.
absl::StatusOr<NamedTensors> ReadPeftAdapter(const std::string& dir,
                                             const LlamaConfig& config,
                                             const LoraConfig& lora) {
  absl::StatusOr<std::string> text = ReadFileUpTo(
      absl::StrCat(dir, "/", kPeftConfigFile), kConfigJsonLimits.max_bytes,
      absl::StatusCode::kInvalidArgument);
  if (!text.ok()) return InitAdapterError(dir, text.status().message());
  TALLY_RETURN_IF_ERROR(CheckPeftAdapterConfig(*text, dir, lora));
  // The factors' names and shapes are checked before any is allocated.
  TALLY_ASSIGN_OR_RETURN(const ExpectedTensors expected,
                         ExpectedTensors::ForModel(config, lora));
  absl::StatusOr<NamedTensors> tensors =
      ReadSafetensors(absl::StrCat(dir, "/", kPeftWeightsFile), nullptr,
                      expected.PeftAdapterScreen());
  if (!tensors.ok()) {
    return absl::Status(tensors.status().code(),
                        absl::StrCat("lora.init_adapter ", dir, ": ",
                                     tensors.status().message()));
  }
  for (auto& [name, t] : *tensors) {
    name = name.substr(sizeof(kPeftKeyPrefix) - 1);
  }
  return tensors;
}

// The factors of a tally checkpoint of an adapter.
absl::StatusOr<NamedTensors> ReadTallyAdapter(const std::string& dir,
                                              const LoraConfig& lora) {
  TALLY_ASSIGN_OR_RETURN(CheckpointContents contents,
                         ReadCheckpoint(dir, /*read_optimizer=*/false));
  const LoraConfig* saved =
      contents.manifest ? &contents.manifest->lora : nullptr;
  if (saved == nullptr || !saved->enabled()) {
    return InitAdapterError(dir, "the checkpoint holds no LoRA adapter");
  }
  if (!SameAdapterShape(*saved, lora)) {
    return InitAdapterError(
        dir, absl::StrCat("its adapter (rank ", saved->rank, ", alpha ",
                          saved->alpha, ", ",
                          absl::StrJoin(LoraTargetModules(*saved), ", "),
                          ") is not lora's"));
  }
  return std::move(contents.weights);
}

}  // namespace

absl::StatusOr<NamedTensors> ReadAdapter(const std::string& dir,
                                         const LlamaConfig& config,
                                         const LoraConfig& lora) {
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) {
    return absl::NotFoundError(
        absl::StrCat("lora.init_adapter ", dir, " is not a directory"));
  }
  TALLY_ASSIGN_OR_RETURN(
      NamedTensors tensors,
      std::filesystem::exists(absl::StrCat(dir, "/", kPeftConfigFile), error)
          ? ReadPeftAdapter(dir, config, lora)
          : ReadTallyAdapter(dir, lora));
  for (const auto& [name, t] : tensors) {
    if (!IsLoraParameter(name)) {
      return InitAdapterError(
          dir, absl::StrCat("it holds ", name, ", which is no LoRA factor"));
    }
  }
  return tensors;
}

}  // namespace tally
