#include "runtime/loss_registry.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/policy_losses.h"

namespace tally {

absl::StatusOr<std::shared_ptr<const TokenLoss>> MakeTokenLoss(
    const LossSpec& spec) {
  // Validates `spec` again, so a hand-made one cannot miss a setting.
  TALLY_ASSIGN_OR_RETURN(const LossSpec valid,
                         ParseLossSpec(spec.name, spec.settings));
  const auto& s = valid.settings;
  if (valid.name == "importance_sampling") {
    return std::make_shared<ImportanceSamplingLoss>();
  }
  if (valid.name == "ppo" || valid.name == "cispo") {
    const ClipRange clip{s.at("clip_low_threshold"),
                         s.at("clip_high_threshold")};
    if (valid.name == "ppo") return std::make_shared<PpoLoss>(clip);
    return std::make_shared<CispoLoss>(clip);
  }
  if (valid.name == "dro") return std::make_shared<DroLoss>(s.at("beta"));
  if (valid.name == "cross_entropy")
    return std::make_shared<CrossEntropyLoss>();
  return absl::InternalError(
      absl::StrCat("loss '", valid.name, "' has no TokenLoss class"));
}

}  // namespace tally
