#include "runtime/parallel/rank_phases.h"

#include <utility>

#include "runtime/parallel/phase_boundary.h"

namespace tally {

absl::Status RankPhases::CollectiveFailure() const {
  return process_groups_ ? process_groups_->failure() : world_->failure();
}

absl::Status RankPhases::AgreeUnlessFailed(Communicator& group,
                                           absl::Status local) const {
  if (absl::Status broken = CollectiveFailure(); !broken.ok()) {
    return local.ok() ? broken : local;
  }
  return AgreeOnStatus(group, std::move(local), "this command");
}

absl::Status RankPhases::Agree(absl::Status local) const {
  return MarkAgreed(AgreeUnlessFailed(*world_, std::move(local)));
}

void RankPhases::FailFast(const absl::Status& local) const {
  if (process_groups_) process_groups_->FailFast(local);
}

absl::Status RankPhases::Finish(absl::Status local) const {
  return process_groups_ ? FinishPhase(*process_groups_, std::move(local))
                         : local;
}

}  // namespace tally
