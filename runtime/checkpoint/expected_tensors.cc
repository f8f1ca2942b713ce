#include "runtime/checkpoint/expected_tensors.h"

#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json_reader.h"
#include "base/status.h"
#include "runtime/model/causal_lm.h"
#include "runtime/model/lora.h"
#include "runtime/parallel/pipeline.h"
#include "runtime/train/optimizer.h"

namespace tally {
namespace {

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool IsFloating(SafetensorsDType dtype) {
  return dtype == SafetensorsDType::kF32 || dtype == SafetensorsDType::kF64 ||
         dtype == SafetensorsDType::kF16 || dtype == SafetensorsDType::kBF16;
}

// `entry` against `shapes`, where it is called `key`: kRead when it is there
// with its shape and, when `floating_only`, a floating point dtype. Errors
// call it `what` and its name.
absl::StatusOr<ScreenVerdict> Expect(
    const std::map<std::string, std::vector<int64_t>>& shapes,
    const std::string& key, const SafetensorsEntry& entry, bool floating_only,
    absl::string_view what) {
  const std::string named = absl::StrCat(what, " ", Excerpt(entry.name));
  const auto it = shapes.find(key);
  if (it == shapes.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(named, " is not a parameter of the model"));
  }
  if (entry.shape != it->second) {
    return absl::InvalidArgumentError(
        absl::StrCat(named, " has shape ", Excerpt(ShapeText(entry.shape)),
                     ", expected ", ShapeText(it->second)));
  }
  if (floating_only && !IsFloating(entry.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(named, " has dtype ", SafetensorsDTypeCode(entry.dtype),
                     ", expected a floating point dtype"));
  }
  return ScreenVerdict::kRead;
}

}  // namespace

absl::StatusOr<ExpectedTensors> ExpectedTensors::ForModel(
    const LlamaConfig& config, const LoraConfig& lora) {
  // The base as placeholders (one element each), its shapes carried through
  // ToHfTensors on meta tensors, which hold no memory either.
  ModelAdapters placeholders;
  placeholders.base_placeholders = true;
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<CausalLm> model,
      CreateCausalLm(config, DType::kFloat32, /*seed=*/0, {}, placeholders));
  return CatchTorch(
      "expected tensors", [&]() -> absl::StatusOr<ExpectedTensors> {
        ExpectedTensors expected;
        expected.tied_ = config.tie_word_embeddings;
        const auto meta = torch::TensorOptions().device(c10::DeviceType::Meta);
        NamedTensors shapes;
        for (const Parameter& p : model->parameters()) {
          expected.parameters_[p.name] = p.full_shape;
          shapes.emplace_back(p.name, torch::empty(p.full_shape, meta));
        }
        const LayerRange every_layer = {0, config.num_hidden_layers};
        for (const ParameterSpec& spec : LoraParameterSpecs(
                 config, lora, every_layer, /*last_stage=*/true)) {
          expected.parameters_[spec.name] = spec.shape;
          expected.adapters_[spec.name] = spec.shape;
          shapes.emplace_back(spec.name, torch::empty(spec.shape, meta));
        }
        for (const auto& [name, t] : model->ToHfTensors(std::move(shapes))) {
          expected.weights_[name] = t.sizes().vec();
        }
        return expected;
      });
}

SafetensorsScreen ExpectedTensors::WeightScreen() const {
  return
      [this](const SafetensorsEntry& entry) -> absl::StatusOr<ScreenVerdict> {
        // Loading ignores these whatever they hold, so they are not read.
        if ((tied_ && entry.name == "lm_head.weight") ||
            absl::EndsWith(entry.name, kRotaryBufferSuffix)) {
          return ScreenVerdict::kSkip;
        }
        return Expect(weights_, entry.name, entry, /*floating_only=*/true,
                      "checkpoint weight");
      };
}

SafetensorsScreen ExpectedTensors::OptimizerStateScreen() const {
  return
      [this](const SafetensorsEntry& entry) -> absl::StatusOr<ScreenVerdict> {
        for (const std::string& suffix :
             Optimizer::StateSuffixes(OptimizerKind::kAdamW)) {
          if (!absl::EndsWith(entry.name, suffix)) continue;
          const std::string parameter =
              entry.name.substr(0, entry.name.size() - suffix.size());
          if (parameters_.count(parameter) == 0) continue;
          return Expect(parameters_, parameter, entry, /*floating_only=*/false,
                        "optimizer state");
        }
        return ScreenVerdict::kSkip;
      };
}

SafetensorsScreen ExpectedTensors::PeftAdapterScreen() const {
  return
      [this](const SafetensorsEntry& entry) -> absl::StatusOr<ScreenVerdict> {
        if (!absl::StartsWith(entry.name, kPeftKeyPrefix)) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor ", Excerpt(entry.name), " lacks the '",
                           kPeftKeyPrefix, "' prefix"));
        }
        const std::string name = entry.name.substr(sizeof(kPeftKeyPrefix) - 1);
        if (!IsLoraParameter(name)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "it holds ", Excerpt(name), ", which is no LoRA factor"));
        }
        return Expect(adapters_, name, entry, /*floating_only=*/true,
                      "adapter factor");
      };
}

}  // namespace tally
