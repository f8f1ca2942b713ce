#include "runtime/train/loss_registry.h"

#include <iterator>
#include <map>
#include <string>

#include "base/status.h"
#include "runtime/config/loss_id.h"
#include "runtime/train/policy_losses.h"

namespace tally {
namespace {

using Settings = std::map<std::string, double>;

// Builds a loss from its validated settings (ParseLossSpec filled them in).
using LossFactory = std::shared_ptr<const TokenLoss> (*)(const Settings&);

struct LossFactoryEntry {
  LossId id;
  LossFactory make;
};

template <typename Loss>
std::shared_ptr<const TokenLoss> Make(const Settings&) {
  return std::make_shared<Loss>();
}

template <typename Loss>
std::shared_ptr<const TokenLoss> MakeClipped(const Settings& s) {
  return std::make_shared<Loss>(
      ClipRange{s.at("clip_low_threshold"), s.at("clip_high_threshold")});
}

std::shared_ptr<const TokenLoss> MakeDro(const Settings& s) {
  return std::make_shared<DroLoss>(s.at("beta"));
}

// The TokenLoss class of every LossId, in id order.
constexpr LossFactoryEntry kLossFactories[] = {
    {LossId::kCrossEntropy, &Make<CrossEntropyLoss>},
    {LossId::kImportanceSampling, &Make<ImportanceSamplingLoss>},
    {LossId::kPpo, &MakeClipped<PpoLoss>},
    {LossId::kCispo, &MakeClipped<CispoLoss>},
    {LossId::kDro, &MakeDro},
};

constexpr bool OneFactoryPerLossInIdOrder() {
  if (static_cast<int>(std::size(kLossFactories)) != kNumLosses) return false;
  for (int i = 0; i < kNumLosses; ++i) {
    if (kLossFactories[i].id != static_cast<LossId>(i)) return false;
  }
  return true;
}
static_assert(OneFactoryPerLossInIdOrder(),
              "kLossFactories needs one entry per LossId, in id order");

}  // namespace

absl::StatusOr<std::shared_ptr<const TokenLoss>> MakeTokenLoss(
    const LossSpec& spec) {
  // Validates `spec` again, so a hand-made one cannot miss a setting.
  TALLY_ASSIGN_OR_RETURN(const LossSpec valid,
                         ParseLossSpec(spec.name, spec.settings));
  TALLY_ASSIGN_OR_RETURN(const LossId id, LossIdOf(valid.name));
  return kLossFactories[static_cast<int>(id)].make(valid.settings);
}

}  // namespace tally
