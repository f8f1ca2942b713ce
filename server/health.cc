#include "server/health.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tally {

Liveness::Liveness(Options options) : options_(std::move(options)) {}

Liveness::~Liveness() = default;

std::unique_ptr<Liveness::Heartbeat> Liveness::Register(std::string name,
                                                        absl::Duration bound) {
  absl::MutexLock lock(&mu_);
  loops_.push_back(Loop{std::move(name), bound, options_.now(), 0});
  return std::unique_ptr<Heartbeat>(
      new Heartbeat(this, std::prev(loops_.end()), bound));
}

absl::Status Liveness::Check() const {
  const absl::Time now = options_.now();
  std::vector<std::string> wedged;
  absl::MutexLock lock(&mu_);
  for (const Loop& loop : loops_) {
    const absl::Duration since = now - loop.last_beat;
    if (loop.busy == 0 && since > loop.bound) {
      wedged.push_back(absl::StrCat(loop.name, " (no heartbeat for ",
                                    absl::FormatDuration(since), ", bound ",
                                    absl::FormatDuration(loop.bound), ")"));
    }
  }
  if (wedged.empty()) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("wedged: ", absl::StrJoin(wedged, ", ")));
}

Liveness::Heartbeat::~Heartbeat() {
  absl::MutexLock lock(&liveness_->mu_);
  liveness_->loops_.erase(loop_);
}

void Liveness::Heartbeat::Beat() {
  if (liveness_->options_.on_beat) liveness_->options_.on_beat(loop_->name);
  const absl::Time now = liveness_->options_.now();
  absl::MutexLock lock(&liveness_->mu_);
  loop_->last_beat = now;
}

Liveness::Busy::Busy(Heartbeat* heartbeat) : heartbeat_(heartbeat) {
  if (heartbeat_ == nullptr) return;
  absl::MutexLock lock(&heartbeat_->liveness_->mu_);
  ++heartbeat_->loop_->busy;
}

Liveness::Busy::~Busy() {
  if (heartbeat_ == nullptr) return;
  {
    absl::MutexLock lock(&heartbeat_->liveness_->mu_);
    if (--heartbeat_->loop_->busy > 0) return;
  }
  heartbeat_->Beat();
}

}  // namespace tally
