// The TokenLoss a LossSpec describes: the torch side of the loss table
// (loss_id.h), a factory per LossId in loss_registry.cc, which a
// static_assert keeps total and in id order. A loss's name and settings are
// its row in loss_spec.cc.
//
//   TALLY_ASSIGN_OR_RETURN(tally::LossSpec spec,
//                          tally::ParseLossSpec("ppo", config));
//   TALLY_ASSIGN_OR_RETURN(std::shared_ptr<const tally::TokenLoss> loss,
//                          tally::MakeTokenLoss(spec));
#ifndef TALLY_RUNTIME_TRAIN_LOSS_REGISTRY_H_
#define TALLY_RUNTIME_TRAIN_LOSS_REGISTRY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "runtime/config/loss_spec.h"
#include "runtime/train/token_loss.h"

namespace tally {

// INVALID_ARGUMENT when `spec`'s name and settings are not what
// ParseLossSpec accepts (a hand-made spec is checked as a request's is).
absl::StatusOr<std::shared_ptr<const TokenLoss>> MakeTokenLoss(
    const LossSpec& spec);

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_LOSS_REGISTRY_H_
