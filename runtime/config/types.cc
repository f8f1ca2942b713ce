#include "runtime/config/types.h"

#include <cmath>
#include <filesystem>

#include "absl/strings/str_cat.h"

namespace tally {

absl::Status ValidateMaxGradNorm(double max_grad_norm,
                                 absl::string_view field) {
  if (std::isfinite(max_grad_norm) && max_grad_norm >= 0) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be finite and >= 0, got ", max_grad_norm));
}

const char* DTypeName(DType dtype) { return NameOf(kDTypeNames, dtype); }

std::optional<DType> DTypeNamed(absl::string_view name) {
  return ValueNamed(kDTypeNames, name);
}

DType MasterDType(DType dtype) {
  return dtype == DType::kBFloat16 ? DType::kFloat32 : dtype;
}

const char* OptimizerName(OptimizerKind optimizer) {
  return NameOf(kOptimizerNames, optimizer);
}

const char* ReductionName(LossReduction reduction) {
  return NameOf(kReductionNames, reduction);
}

AdamParams AdamOverrides::ResolveAgainst(const AdamParams& defaults) const {
  AdamParams p = defaults;
  if (learning_rate) p.learning_rate = *learning_rate;
  if (beta1) p.beta1 = *beta1;
  if (beta2) p.beta2 = *beta2;
  if (eps) p.eps = *eps;
  if (weight_decay) p.weight_decay = *weight_decay;
  return p;
}

std::string BaseKey(const ModelSpec& spec,
                    absl::string_view checkpoint_identity) {
  if (!spec.lora.enabled()) return "";
  // One spelling per directory: "a//b/" and "a/b" are one base.
  std::filesystem::path dir =
      std::filesystem::path(spec.init_checkpoint).lexically_normal();
  if (!dir.has_filename()) dir = dir.parent_path();
  const std::string source =
      spec.init_checkpoint.empty()
          ? absl::StrCat(
                "seed ", spec.seed, " config ",
                spec.config.WithDefaults().ToHfJson(DTypeName(spec.dtype)))
          : absl::StrCat("checkpoint ", dir.string(), " ", checkpoint_identity);
  // A tenant's models ("<tenant>/<id>") share bases among themselves only.
  const size_t scope = spec.model_id.find('/');
  return absl::StrCat(
      scope == std::string::npos ? "" : spec.model_id.substr(0, scope + 1),
      DTypeName(spec.dtype), " ", source);
}

std::optional<ZeroStage> ZeroStageNumbered(int64_t stage) {
  for (ZeroStage zero : {ZeroStage::kOptimizerState, ZeroStage::kGradients,
                         ZeroStage::kParameters}) {
    if (stage == static_cast<int64_t>(zero)) return zero;
  }
  return std::nullopt;
}

const char* AttentionModeName(AttentionMode mode) {
  return NameOf(kAttentionModeNames, mode);
}

std::optional<AttentionMode> AttentionModeNamed(absl::string_view name) {
  return ValueNamed(kAttentionModeNames, name);
}

}  // namespace tally
