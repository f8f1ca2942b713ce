#include "runtime/parallel/phase_boundary.h"

#include <utility>

#include "absl/strings/cord.h"
#include "runtime/parallel/communicator.h"

namespace tally {
namespace {

// Marks a status every rank holds (MarkAgreed).
constexpr char kAgreedPayload[] = "tally.dev/agreed";

}  // namespace

absl::Status MarkAgreed(absl::Status status) {
  if (!status.ok()) status.SetPayload(kAgreedPayload, absl::Cord());
  return status;
}

bool IsAgreed(const absl::Status& status) {
  return status.GetPayload(kAgreedPayload).has_value();
}

absl::Status FinishPhase(ProcessGroups& groups, absl::Status local) {
  if (!local.ok() && !IsAgreed(local)) groups.FailFast(local);
  if (groups.failure().ok() && !IsAgreed(local)) {
    local = AgreeOnStatus(groups.world(), std::move(local), "this command");
  }
  return MarkAgreed(groups.Recover(std::move(local)));
}

}  // namespace tally
