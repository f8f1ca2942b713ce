#include "server/progress_watch.h"

#include "absl/strings/str_cat.h"

namespace tally {

ProgressWatch::Scope::Scope(ProgressWatch* watch) : watch_(watch) {
  if (watch_ == nullptr) return;
  const absl::Time now = watch_->now_();
  absl::MutexLock lock(&watch_->mu_);
  outer_ = watch_->running_since_;
  if (!outer_) watch_->running_since_ = now;
}

ProgressWatch::Scope::~Scope() {
  if (watch_ == nullptr) return;
  absl::MutexLock lock(&watch_->mu_);
  watch_->running_since_ = outer_;
}

absl::Status ProgressWatch::Check() const {
  std::optional<absl::Time> since;
  {
    absl::MutexLock lock(&mu_);
    since = running_since_;
  }
  if (!since) return absl::OkStatus();
  const absl::Duration running = now_() - *since;
  if (running <= limit_) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "no progress: a command has run for ", absl::FormatDuration(running),
      ", longer than the collective timeout (", absl::FormatDuration(limit_),
      "); a rank may be hung"));
}

}  // namespace tally
