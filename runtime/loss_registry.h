// The TokenLoss a LossSpec describes: the one place that knows every loss
// class (a new loss is named here and in loss_spec.cc).
//
//   TALLY_ASSIGN_OR_RETURN(tally::LossSpec spec,
//                          tally::ParseLossSpec("ppo", config));
//   TALLY_ASSIGN_OR_RETURN(std::shared_ptr<const tally::TokenLoss> loss,
//                          tally::MakeTokenLoss(spec));
#ifndef TALLY_RUNTIME_LOSS_REGISTRY_H_
#define TALLY_RUNTIME_LOSS_REGISTRY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "runtime/loss_spec.h"
#include "runtime/token_loss.h"

namespace tally {

// INVALID_ARGUMENT when `spec` is not what ParseLossSpec returns.
absl::StatusOr<std::shared_ptr<const TokenLoss>> MakeTokenLoss(
    const LossSpec& spec);

}  // namespace tally

#endif  // TALLY_RUNTIME_LOSS_REGISTRY_H_
