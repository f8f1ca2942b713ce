// ProgressWatch: whether the command a rank is executing has run for longer
// than a collective may wait (--collective-timeout-secs), i.e. whether the
// rank stopped making progress, so that /readyz turns 503 while the command
// hangs rather than only once the collective gives up.
//
// The command thread marks each command with a Scope; probes call Check()
// from any thread. Idle time (no command) never counts.
//
//   tally::ProgressWatch watch(absl::Seconds(options.collective_timeout_secs));
//   metrics->SetReadinessCheck([&] { return watch.Check(); });
//   {
//     tally::ProgressWatch::Scope running(&watch);
//     ...  // the command
//   }
#ifndef TALLY_SERVER_PROGRESS_WATCH_H_
#define TALLY_SERVER_PROGRESS_WATCH_H_

#include <functional>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tally {

class ProgressWatch {
 public:
  // `now`: the clock (tests pass their own).
  explicit ProgressWatch(absl::Duration limit,
                         std::function<absl::Time()> now = &absl::Now)
      : limit_(limit), now_(std::move(now)) {}

  // Marks a command running for its lifetime (null `watch`: nothing); a
  // scope inside another one changes nothing.
  class Scope {
   public:
    explicit Scope(ProgressWatch* watch);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ProgressWatch* watch_;
    std::optional<absl::Time> outer_;  // the enclosing scope's start
  };

  // UNAVAILABLE, saying for how long, once the running command has run for
  // longer than the limit; else OK.
  absl::Status Check() const;

 private:
  const absl::Duration limit_;
  const std::function<absl::Time()> now_;
  mutable absl::Mutex mu_;
  std::optional<absl::Time> running_since_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tally

#endif  // TALLY_SERVER_PROGRESS_WATCH_H_
