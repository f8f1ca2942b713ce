// Liveness (/healthz): a loop that stops beating outside a command is
// wedged, a long command is not; the executor's and the sequencer's loops
// beat on it. The clock is the test's, and a test hook in Heartbeat::Beat
// wedges a real loop at a known point, so nothing waits on time.
#include "server/health.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/executor.h"
#include "server/sequencer.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

// A clock the test moves, and a hook that wedges the loop named `wedge_`
// in its next beat until released.
class LivenessTest : public ::testing::Test {
 protected:
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  // The next beat of `loop` blocks (wedged_ notified) until Release().
  void WedgeNextBeat(const std::string& loop) {
    absl::MutexLock lock(&mu_);
    wedge_ = loop;
  }
  void Release() { release_.Notify(); }

  void OnBeat(absl::string_view loop) {
    {
      absl::MutexLock lock(&mu_);
      if (loop != wedge_) return;
      wedge_.clear();
    }
    wedged_.Notify();
    release_.WaitForNotification();
  }

  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::UnixEpoch();
  std::string wedge_ ABSL_GUARDED_BY(mu_);
  absl::Notification wedged_;
  absl::Notification release_;
  Liveness liveness_{
      Liveness::Options{[this] { return Now(); },
                        [this](absl::string_view loop) { OnBeat(loop); }}};
};

TEST_F(LivenessTest, ALoopThatStopsBeatingIsWedged) {
  auto heartbeat = liveness_.Register("timer", absl::Seconds(10));
  EXPECT_EQ(heartbeat->period(), absl::Milliseconds(2500));
  Advance(absl::Seconds(10));
  EXPECT_TRUE(liveness_.Check().ok());  // up to the bound
  Advance(absl::Milliseconds(1));
  const absl::Status wedged = liveness_.Check();
  EXPECT_EQ(wedged.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(wedged.message()),
              HasSubstr("timer (no heartbeat for 10.001s, bound 10s)"));
  heartbeat->Beat();
  EXPECT_TRUE(liveness_.Check().ok());
}

TEST_F(LivenessTest, ABusyLoopIsNotWedgedHoweverLongItTakes) {
  auto heartbeat = liveness_.Register("executor", absl::Seconds(10));
  {
    Liveness::Busy command(heartbeat.get());
    {
      Liveness::Busy nested(heartbeat.get());
      Advance(absl::Hours(5));
    }
    EXPECT_TRUE(liveness_.Check().ok());  // still in the outer scope
    Advance(absl::Hours(5));
    EXPECT_TRUE(liveness_.Check().ok());
  }
  // Leaving the command beat: the bound counts from its end.
  Advance(absl::Seconds(10));
  EXPECT_TRUE(liveness_.Check().ok());
  Advance(absl::Seconds(1));
  EXPECT_FALSE(liveness_.Check().ok());
}

TEST_F(LivenessTest, NamesEveryWedgedLoopAndForgetsEndedOnes) {
  auto a = liveness_.Register("a", absl::Seconds(1));
  auto b = liveness_.Register("b", absl::Seconds(5));
  Advance(absl::Seconds(6));
  EXPECT_THAT(std::string(liveness_.Check().message()),
              HasSubstr("wedged: a (no heartbeat for 6s, bound 1s), b ("));
  b.reset();  // the loop ended in order
  EXPECT_THAT(std::string(liveness_.Check().message()),
              ::testing::Not(HasSubstr("b (")));
  a.reset();
  EXPECT_TRUE(liveness_.Check().ok());
}

TEST_F(LivenessTest, TheExecutorIsBusyWhileACommandRuns) {
  CommandExecutor executor(&liveness_);
  absl::Notification started, finish, done;
  ASSERT_TRUE(executor.Submit([&] {
    started.Notify();
    finish.WaitForNotification();
  }));
  started.WaitForNotification();
  Advance(absl::Hours(1));
  EXPECT_TRUE(liveness_.Check().ok());
  finish.Notify();
  // Once the next command runs, the loop beat after the long one.
  ASSERT_TRUE(executor.Submit([&] { done.Notify(); }));
  done.WaitForNotification();
  EXPECT_TRUE(liveness_.Check().ok());
  executor.Stop();
}

TEST_F(LivenessTest, AWedgedExecutorFailsTheCheckUntilItBeatsAgain) {
  CommandExecutor executor(&liveness_);
  WedgeNextBeat("executor");
  // The beat after this command wedges the loop, outside any command.
  ASSERT_TRUE(executor.Submit([] {}));
  wedged_.WaitForNotification();
  Advance(Liveness::kLoopBound + absl::Seconds(1));
  const absl::Status wedged = liveness_.Check();
  EXPECT_EQ(wedged.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(wedged.message()), HasSubstr("executor"));

  Release();
  absl::Notification ran;
  ASSERT_TRUE(executor.Submit([&] { ran.Notify(); }));
  ran.WaitForNotification();  // the loop beat on its way to this command
  EXPECT_TRUE(liveness_.Check().ok());
  executor.Stop();
  // A stopped executor is no loop to watch.
  Advance(Liveness::kLoopBound * 2);
  EXPECT_TRUE(liveness_.Check().ok());
}

TEST_F(LivenessTest, AWedgedSequencerTimerFailsTheCheck) {
  WedgeNextBeat("sequencer");
  SequencerOptions options;
  options.liveness = &liveness_;
  CommandExecutor executor;
  SequencerHooks hooks;
  hooks.dispatch = [&](std::function<void()> work) {
    return executor.Submit(std::move(work));
  };
  auto sequencer = std::make_unique<Sequencer>(options, hooks);
  wedged_.WaitForNotification();  // the gap timer's first beat
  Advance(Liveness::kLoopBound + absl::Seconds(1));
  EXPECT_THAT(std::string(liveness_.Check().message()),
              HasSubstr("wedged: sequencer ("));
  Release();
  sequencer.reset();  // joins the timer, which stops being watched
  EXPECT_TRUE(liveness_.Check().ok());
}

}  // namespace
}  // namespace tally
