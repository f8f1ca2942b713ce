// LossId: every loss tally knows, by id — the key of the loss table.
//
// The loss table registers each loss once: its id here, its name and
// settings in loss_spec.cc (torch-free: the front end validates a request's
// loss without LibTorch) and its TokenLoss factory in loss_registry.cc,
// which a static_assert keeps total and in id order.
//
//   tally::LossName(tally::LossId::kPpo);  // "ppo"
//   TALLY_ASSIGN_OR_RETURN(tally::LossId id, tally::LossIdOf("ppo"));
#ifndef TALLY_RUNTIME_CONFIG_LOSS_ID_H_
#define TALLY_RUNTIME_CONFIG_LOSS_ID_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

// In the order of v1::LossFn (LOSS_FN_<NAME> is the id + 1). A new loss
// takes the next value.
enum class LossId : int {
  kCrossEntropy,
  kImportanceSampling,
  kPpo,
  kCispo,
  kDro,
};
// The number of LossId values: the last one + 1.
inline constexpr int kNumLosses = static_cast<int>(LossId::kDro) + 1;

// The name of loss `id` in the table, e.g. "ppo".
const char* LossName(LossId id);

// The id of the loss named `name`; INVALID_ARGUMENT naming loss_fn and
// listing the names when there is none.
absl::StatusOr<LossId> LossIdOf(absl::string_view name);

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_LOSS_ID_H_
