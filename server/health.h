// Liveness: whether a rank's loops can still make progress, which /healthz
// answers (server/http_endpoint.h) and so what makes Kubernetes restart a
// pod (docs/deploy.md, "What /healthz checks").
//
// Each long-lived loop (the command executor, the sequencer's gap timer)
// holds a Heartbeat and beats at least every `bound` while it waits for
// work. A loop running a command marks itself Busy for as long as the
// command runs: a long command is not a wedge (a multi-rank command that
// stops progressing makes /readyz fail instead, and its collective times
// out: server/progress_watch.h). Check() fails, naming the loop, once a
// loop that is not busy has not beaten for longer than its bound: it is
// stuck outside a command (a deadlock, a blocked call).
//
//   tally::Liveness liveness;
//   std::unique_ptr<tally::Liveness::Heartbeat> heartbeat =
//       liveness.Register("executor", tally::Liveness::kLoopBound);
//   while (...) {
//     heartbeat->Beat();
//     ...  // wait for work, at most heartbeat->period()
//     tally::Liveness::Busy busy(heartbeat.get());
//     ...  // the command
//   }
//   http->SetLivenessCheck([&] { return liveness.Check(); });
#ifndef TALLY_SERVER_HEALTH_H_
#define TALLY_SERVER_HEALTH_H_

#include <functional>
#include <list>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tally {

class Liveness {
 public:
  struct Options {
    // The clock (tests pass their own).
    std::function<absl::Time()> now = &absl::Now;
    // Test hook: runs on a loop's thread at the start of each Beat(), with
    // the loop's name; a hook that blocks wedges the loop.
    std::function<void(absl::string_view loop)> on_beat;
  };

  class Heartbeat;

  // The server's loops' bound: long enough that a loaded machine's late
  // wakeups never read as a wedge, short against a probe's patience.
  static constexpr absl::Duration kLoopBound = absl::Seconds(60);

  Liveness() : Liveness(Options()) {}
  explicit Liveness(Options options);
  ~Liveness();
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  // A loop called `name` that beats at least every `bound` (> 0) while not
  // busy; it has beaten now. Destroying the Heartbeat (the loop ended in
  // order) stops watching it; it must not outlive the Liveness.
  std::unique_ptr<Heartbeat> Register(std::string name, absl::Duration bound);

  // OK while every registered loop is busy or beat within its bound; else
  // UNAVAILABLE naming the loops and how long since each beat.
  absl::Status Check() const;

  // Marks a heartbeat's loop busy for the scope's lifetime (null: nothing);
  // scopes nest. Leaving the outermost scope beats.
  class Busy {
   public:
    explicit Busy(Heartbeat* heartbeat);
    ~Busy();
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    Heartbeat* const heartbeat_;
  };

 private:
  struct Loop {
    std::string name;
    absl::Duration bound;
    absl::Time last_beat;
    int busy = 0;
  };

  const Options options_;
  mutable absl::Mutex mu_;
  std::list<Loop> loops_ ABSL_GUARDED_BY(mu_);
};

class Liveness::Heartbeat {
 public:
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // The loop is alive now.
  void Beat();
  // How long the loop may wait for work between beats: a quarter of the
  // bound, so that a late wakeup does not read as a wedge.
  absl::Duration period() const { return period_; }

 private:
  friend class Liveness;
  Heartbeat(Liveness* liveness, std::list<Loop>::iterator loop,
            absl::Duration bound)
      : liveness_(liveness), loop_(loop), period_(bound / 4) {}

  Liveness* const liveness_;
  const std::list<Loop>::iterator loop_;
  const absl::Duration period_;
};

}  // namespace tally

#endif  // TALLY_SERVER_HEALTH_H_
