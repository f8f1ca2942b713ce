// The RequestScheduler with a real CommandExecutor and a stand-in engine:
// a command that throws is answered INTERNAL without ending the process,
// and a stress of creates, deletes, re-creates, restores and training calls
// (sequenced and unsequenced, duplicated, given up) from many threads answers
// every request exactly once, never runs a request of one incarnation on
// another, and returns the request budget to 0. Back-pressure cannot poison
// a window the clients did not break: callers that give up while waiting
// free their slots at once, the next seq_id is always admitted, and a load
// of clients with short deadlines retrying as the docs say poisons nothing.
#include "server/request_scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/status.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

// Counts the replies of every scheduled request.
class Replies {
 public:
  // A reply callback for a new request; its index names it.
  std::function<void(const absl::Status&)> Expect() {
    absl::MutexLock lock(&mu_);
    const size_t index = counts_.size();
    counts_.push_back(0);
    codes_.emplace_back();
    return [this, index](const absl::Status& status) {
      absl::MutexLock lock(&mu_);
      ++counts_[index];
      codes_[index] = status.code();
      ++total_;
    };
  }
  bool AwaitAll(absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    auto all = [this] { return total_ >= counts_.size(); };
    return mu_.AwaitWithTimeout(absl::Condition(&all), timeout);
  }
  // Requests not answered exactly once.
  std::vector<size_t> NotAnsweredOnce() const {
    absl::MutexLock lock(&mu_);
    std::vector<size_t> wrong;
    for (size_t i = 0; i < counts_.size(); ++i) {
      if (counts_[i] != 1) wrong.push_back(i);
    }
    return wrong;
  }
  absl::StatusCode code(size_t index) const {
    absl::MutexLock lock(&mu_);
    return codes_[index];
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<int> counts_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::StatusCode> codes_ ABSL_GUARDED_BY(mu_);
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
};

RequestSchedulerOptions Options() {
  RequestSchedulerOptions options;
  options.sequencing.gap_timeout = absl::Milliseconds(20);
  options.sequencing.restored_gap_timeout = absl::Milliseconds(5);
  // Room for every request of the stress test: none is refused, so what
  // runs does not depend on timing.
  options.budget = {/*total=*/4096, /*per_tenant=*/4096, /*per_model=*/4096};
  return options;
}

// While a command runs, a decode in it finds the request's stop_check and
// the scheduler's progress hook as the thread's DecodeControl; none before
// or after it.
TEST(RequestSchedulerTest, ARunningCommandSeesItsStopCheckAsDecodeControl) {
  CommandExecutor executor;
  std::vector<std::string> progress;
  RequestSchedulerHooks hooks;
  hooks.on_decode_progress = [&](const std::string& model_id,
                                 const DecodeStats& stats) {
    progress.push_back(absl::StrCat(model_id, " step ", stats.step));
  };
  RequestScheduler scheduler(Options(), &executor, hooks);
  absl::Notification answered;
  absl::Status stop_seen, answer;
  bool installed_after = true;
  ScheduledRequest r;
  r.model_id = "m";
  r.precheck = [] { return absl::OkStatus(); };
  r.stop_check = [] { return absl::CancelledError("the caller gave up"); };
  r.run = [&] {
    const DecodeControl* control = ScopedDecodeControl::Current();
    if (control == nullptr) return absl::InternalError("no DecodeControl");
    DecodeStats stats;
    stats.step = 3;
    control->on_progress(stats);
    stop_seen = control->stop();
    return stop_seen;
  };
  r.reply = [&](const absl::Status& status) {
    answer = status;
    installed_after = ScopedDecodeControl::Current() != nullptr;
    answered.Notify();
  };
  scheduler.Schedule(std::move(r));
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(30)));
  executor.Stop();
  EXPECT_EQ(stop_seen.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(answer.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(progress, std::vector<std::string>{"m step 3"});
  EXPECT_FALSE(installed_after);
  EXPECT_EQ(ScopedDecodeControl::Current(), nullptr);
}

TEST(RequestSchedulerTest, AThrowingCommandIsAnsweredInternalAndReported) {
  CommandExecutor executor;
  std::vector<std::string> reported;
  RequestSchedulerHooks hooks;
  hooks.on_command_exception = [&](const std::string& model_id,
                                   const std::string& what) {
    reported.push_back(absl::StrCat(model_id, ": ", what));
  };
  RequestScheduler scheduler(Options(), &executor, hooks);
  scheduler.sequencer().AddModel("m");
  absl::Mutex mu;
  std::vector<absl::Status> answers;
  auto request = [&](uint64_t seq_id, bool throws) {
    ScheduledRequest r;
    r.model_id = "m";
    r.seq_id = seq_id;
    r.fingerprint = seq_id;
    r.precheck = [] { return absl::OkStatus(); };
    r.run = [throws]() -> absl::Status {
      if (throws) throw std::runtime_error("boom\nbacktrace");
      return absl::OkStatus();
    };
    r.save_response = [] { return std::string(); };
    r.load_response = [](const std::string&) { return true; };
    r.reply = [&](const absl::Status& status) {
      absl::MutexLock lock(&mu);
      answers.push_back(status);
    };
    return r;
  };
  scheduler.Schedule(request(0, /*throws=*/true));
  scheduler.Schedule(request(1, /*throws=*/true));
  scheduler.Schedule(request(2, /*throws=*/false));  // the executor goes on
  {
    absl::MutexLock lock(&mu);
    auto three = [&] { return answers.size() == 3; };
    ASSERT_TRUE(
        mu.AwaitWithTimeout(absl::Condition(&three), absl::Seconds(30)));
  }
  executor.Stop();
  ASSERT_EQ(answers.size(), 3u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(answers[i].code(), absl::StatusCode::kInternal);
    EXPECT_THAT(answers[i].message(), HasSubstr("boom"));
    EXPECT_THAT(answers[i].message(), ::testing::Not(HasSubstr("backtrace")));
  }
  EXPECT_TRUE(answers[2].ok());
  EXPECT_THAT(reported, ::testing::ElementsAre("m: boom", "m: boom"));
  EXPECT_EQ(scheduler.held(), 0u);
  EXPECT_EQ(scheduler.extra_replies(), 0u);
}

// The stand-in engine: models by id, each create a new incarnation; every
// sequenced request records the incarnation it was accepted for and checks,
// when it runs, that the model is still that incarnation and that its
// seq_ids run 1, 2, 3, ... without a repeat.
class FakeEngine {
 public:
  // On the executor thread, like every command.
  absl::Status Create(const std::string& id, Sequencer& sequencer) {
    if (incarnation_.count(id)) return absl::AlreadyExistsError(id);
    incarnation_[id] = ++incarnations_;
    last_seq_[id] = 0;
    sequencer.AddModel(id);
    return absl::OkStatus();
  }
  absl::Status Delete(const std::string& id, Sequencer& sequencer) {
    if (!incarnation_.erase(id)) return absl::NotFoundError(id);
    sequencer.RemoveModel(id);
    return absl::OkStatus();
  }
  // A LoadCheckpoint that restores the sequence to `next_seq_id`.
  absl::Status Restore(const std::string& id, uint64_t next_seq_id,
                       Sequencer& sequencer) {
    if (!incarnation_.count(id)) return absl::NotFoundError(id);
    SequencerState state;
    state.next_seq_id = next_seq_id;
    TALLY_RETURN_IF_ERROR(sequencer.ImportState(id, state));
    last_seq_[id] = next_seq_id - 1;
    return absl::OkStatus();
  }
  absl::Status Train(const std::string& id, uint64_t seq_id) {
    auto it = incarnation_.find(id);
    if (it == incarnation_.end()) return absl::NotFoundError(id);
    if (seq_id > 0) {
      if (seq_id != last_seq_[id] + 1) {
        violations_.push_back(
            absl::StrCat(id, " ran seq_id ", seq_id, " after ", last_seq_[id]));
      }
      last_seq_[id] = seq_id;
    }
    return absl::OkStatus();
  }
  const std::vector<std::string>& violations() const { return violations_; }

 private:
  std::map<std::string, uint64_t> incarnation_;
  std::map<std::string, uint64_t> last_seq_;
  uint64_t incarnations_ = 0;
  std::vector<std::string> violations_;
};

TEST(RequestSchedulerConcurrencyTest, StressAnswersEveryRequestExactlyOnce) {
  constexpr int kThreads = 8;
  constexpr int kRequestsPerThread = 400;
  const std::vector<std::string> kModels = {"a", "b", "c"};
  CommandExecutor executor;
  FakeEngine engine;
  std::atomic<int> exceptions{0};
  RequestSchedulerHooks hooks;
  hooks.on_command_exception = [&](const std::string&, const std::string&) {
    ++exceptions;
  };
  Replies replies;
  std::atomic<int> throwing{0};
  {
    RequestScheduler scheduler(Options(), &executor, hooks);
    Sequencer& sequencer = scheduler.sequencer();
    for (const std::string& id : kModels) {
      ASSERT_TRUE(engine.Create(id, sequencer).ok());
    }
    // Seq_ids the clients hand out per model; a client does not know of a
    // delete, so old numbers reach new incarnations (and wait, then abort).
    std::map<std::string, std::atomic<uint64_t>> next_seq;
    for (const std::string& id : kModels) next_seq[id] = 1;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(1000 + t);
        for (int i = 0; i < kRequestsPerThread; ++i) {
          const std::string& id = kModels[rng() % kModels.size()];
          ScheduledRequest r;
          r.model_id = id;
          const int kind = rng() % 24;
          const bool gives_up = kind != 4 && rng() % 10 == 0;
          r.precheck = [gives_up] {
            return gives_up ? absl::CancelledError("gave up")
                            : absl::OkStatus();
          };
          r.save_response = [] { return std::string("r"); };
          r.load_response = [](const std::string& b) { return b == "r"; };
          r.reply = replies.Expect();
          if (kind == 4) {
            ++throwing;
            r.run = []() -> absl::Status {
              throw std::runtime_error("injected");
            };
          } else if (kind < 2) {
            r.run = [&, id] { return engine.Create(id, sequencer); };
          } else if (kind == 2) {
            r.run = [&, id] { return engine.Delete(id, sequencer); };
          } else if (kind == 3) {
            const uint64_t to = 1 + rng() % 4;
            r.run = [&, id, to] {
              next_seq.at(id) = to;
              return engine.Restore(id, to, sequencer);
            };
          } else if (kind < 10) {
            r.run = [&, id] { return engine.Train(id, 0); };
          } else {
            // Sequenced: a fresh seq_id, or a duplicate of a recent one.
            uint64_t seq_id = next_seq.at(id)++;
            if (rng() % 4 == 0 && seq_id > 2) seq_id -= 1 + rng() % 2;
            r.seq_id = seq_id;
            r.fingerprint = seq_id;
            r.run = [&, id, seq_id] { return engine.Train(id, seq_id); };
          }
          scheduler.Schedule(std::move(r));
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    ASSERT_TRUE(replies.AwaitAll(absl::Seconds(120)));
    executor.Stop();
    EXPECT_EQ(scheduler.held(), 0u);
    EXPECT_EQ(scheduler.extra_replies(), 0u);
  }
  EXPECT_THAT(replies.NotAnsweredOnce(), ::testing::IsEmpty());
  EXPECT_THAT(engine.violations(), ::testing::IsEmpty());
  EXPECT_GT(throwing.load(), 0);
  EXPECT_EQ(exceptions.load(), throwing.load());
}

// A sequenced call as a client makes it. GiveUp is what the service does
// when gRPC reports the call cancelled or past its deadline: the precheck
// refuses from then on, and the request is withdrawn.
class Call {
 public:
  Call(RequestScheduler& scheduler, const std::string& model_id,
       uint64_t seq_id, std::function<absl::Status()> run)
      : scheduler_(scheduler) {
    ScheduledRequest request;
    request.model_id = model_id;
    request.seq_id = seq_id;
    request.fingerprint = seq_id;
    request.precheck = [state = state_] {
      return state->gave_up ? absl::DeadlineExceededError("gave up")
                            : absl::OkStatus();
    };
    request.run = std::move(run);
    request.save_response = [] { return std::string("r"); };
    request.load_response = [](const std::string& b) { return b == "r"; };
    request.reply = [state = state_](const absl::Status& status) {
      absl::MutexLock lock(&state->mu);
      ++state->replies;
      state->status = status;
    };
    ticket_ = scheduler.Schedule(std::move(request));
  }

  void GiveUp() {
    state_->gave_up = true;
    scheduler_.Withdraw(ticket_, absl::DeadlineExceededError("gave up"));
  }
  // The answer, once there is one within `timeout`; nullopt otherwise.
  std::optional<absl::Status> Await(absl::Duration timeout) const {
    absl::MutexLock lock(&state_->mu);
    auto answered = [this] { return state_->replies > 0; };
    if (!state_->mu.AwaitWithTimeout(absl::Condition(&answered), timeout)) {
      return std::nullopt;
    }
    return state_->status;
  }
  // The answer if there is one now.
  std::optional<absl::Status> answer() const {
    return Await(absl::ZeroDuration());
  }
  int replies() const {
    absl::MutexLock lock(&state_->mu);
    return state_->replies;
  }

 private:
  struct State {
    std::atomic<bool> gave_up{false};
    absl::Mutex mu;
    int replies ABSL_GUARDED_BY(mu) = 0;
    absl::Status status ABSL_GUARDED_BY(mu);
  };
  RequestScheduler& scheduler_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
  RequestTicket ticket_;
};

// The seq_ids a test's commands ran, in order.
class RunLog {
 public:
  std::function<absl::Status()> Run(uint64_t seq_id) {
    return [this, seq_id] {
      absl::MutexLock lock(&mu_);
      ran_.push_back(seq_id);
      return absl::OkStatus();
    };
  }
  std::vector<uint64_t> ran() const {
    absl::MutexLock lock(&mu_);
    return ran_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<uint64_t> ran_;
};

// Keeps the executor busy with a call of model "other" until Release():
// what queues behind it waits. Released and the executor stopped when it
// goes out of scope at the latest, so a test whose assertion fails ends
// instead of hanging.
class BusyExecutor {
 public:
  BusyExecutor(RequestScheduler& scheduler, CommandExecutor& executor)
      : executor_(executor), busy_(scheduler, "other", 1, [this] {
          release_.WaitForNotification();
          return absl::OkStatus();
        }) {}
  ~BusyExecutor() {
    Release();
    executor_.Stop();
  }
  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
  }
  const Call& call() const { return busy_; }

 private:
  CommandExecutor& executor_;
  absl::Notification release_;
  Call busy_;
};

// The example of docs/reliability.md ("Back-pressure and retries"):
// --max-queued-requests-per-model 3, the executor busy; seq_ids 1-3 sent with
// deadlines that pass while they wait, then 4 likewise. Their
// callers are answered at once and free their slots, so the retries (as the
// docs prescribe) get in and run, each seq_id once; nothing times out.
TEST(RequestSchedulerTest, CallersThatGiveUpWhileWaitingFreeTheirSlotsAtOnce) {
  CommandExecutor executor;
  std::atomic<int> gap_timeouts{0};
  RequestSchedulerHooks hooks;
  hooks.on_gap_timeout = [&](const std::string&) { ++gap_timeouts; };
  RequestSchedulerOptions options = Options();
  options.sequencing.gap_timeout = absl::Seconds(60);
  options.budget = {/*total=*/64, /*per_tenant=*/64, /*per_model=*/3};
  RequestScheduler scheduler(options, &executor, hooks);
  scheduler.sequencer().AddModel("m");
  scheduler.sequencer().AddModel("other");
  BusyExecutor busy(scheduler, executor);
  RunLog log;
  std::vector<std::unique_ptr<Call>> expired;
  for (uint64_t seq_id = 1; seq_id <= 3; ++seq_id) {
    expired.push_back(
        std::make_unique<Call>(scheduler, "m", seq_id, log.Run(seq_id)));
  }
  EXPECT_EQ(scheduler.held(), 4u);
  for (auto& call : expired) call->GiveUp();
  // Answered now, while the executor is still busy; their slots are free.
  for (auto& call : expired) {
    ASSERT_TRUE(call->answer().has_value());
    EXPECT_EQ(call->answer()->code(), absl::StatusCode::kDeadlineExceeded);
  }
  EXPECT_EQ(scheduler.held(), 1u);
  Call fourth(scheduler, "m", 4, log.Run(4));
  EXPECT_EQ(fourth.replies(), 0);  // admitted, waiting
  fourth.GiveUp();
  ASSERT_TRUE(fourth.answer().has_value());
  EXPECT_EQ(fourth.answer()->code(), absl::StatusCode::kDeadlineExceeded);

  std::vector<std::unique_ptr<Call>> retries;
  for (uint64_t seq_id = 1; seq_id <= 3; ++seq_id) {
    retries.push_back(
        std::make_unique<Call>(scheduler, "m", seq_id, log.Run(seq_id)));
    EXPECT_FALSE(retries.back()->answer().has_value())
        << "the retry of seq_id " << seq_id << " was answered "
        << *retries.back()->answer() << " instead of waiting for its turn";
  }
  busy.Release();
  for (auto& call : retries) {
    const std::optional<absl::Status> answer = call->Await(absl::Seconds(30));
    ASSERT_TRUE(answer.has_value());
    EXPECT_TRUE(answer->ok()) << *answer;
  }
  Call fourth_retry(scheduler, "m", 4, log.Run(4));
  const std::optional<absl::Status> answer =
      fourth_retry.Await(absl::Seconds(30));
  ASSERT_TRUE(answer.has_value());
  EXPECT_TRUE(answer->ok()) << *answer;
  EXPECT_THAT(log.ran(), ::testing::ElementsAre(1, 2, 3, 4));
  for (auto& call : expired) EXPECT_EQ(call->replies(), 1);
  EXPECT_EQ(fourth.replies(), 1);
  ASSERT_TRUE(busy.call().Await(absl::Seconds(30)).has_value());
  executor.Stop();
  EXPECT_EQ(gap_timeouts.load(), 0);
  EXPECT_EQ(scheduler.held(), 0u);
  EXPECT_EQ(scheduler.extra_replies(), 0u);
}

// Live requests waiting behind a gap fill every limit; the missing seq_id,
// the one they wait for, still gets in (the model's reserved slot), once.
TEST(RequestSchedulerTest, TheNextSeqIdIsAdmittedWhenEveryLimitIsReached) {
  CommandExecutor executor;
  RequestSchedulerOptions options = Options();
  options.sequencing.gap_timeout = absl::Seconds(60);
  options.budget = {/*total=*/3, /*per_tenant=*/3, /*per_model=*/2};
  RequestScheduler scheduler(options, &executor, {});
  scheduler.sequencer().AddModel("m");
  scheduler.sequencer().AddModel("other");
  BusyExecutor busy(scheduler, executor);
  RunLog log;
  Call two(scheduler, "m", 2, log.Run(2));
  Call three(scheduler, "m", 3, log.Run(3));
  Call four(scheduler, "m", 4, log.Run(4));  // not the one they wait for
  ASSERT_TRUE(four.answer().has_value());
  EXPECT_EQ(four.answer()->code(), absl::StatusCode::kResourceExhausted);
  Call one(scheduler, "m", 1, log.Run(1));
  EXPECT_FALSE(one.answer().has_value()) << *one.answer();
  // One reserved slot per model: what the server holds stays bounded.
  Call one_again(scheduler, "m", 1, log.Run(1));
  ASSERT_TRUE(one_again.answer().has_value());
  EXPECT_EQ(one_again.answer()->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(scheduler.held(), 4u);
  busy.Release();
  for (Call* call : {&one, &two, &three}) {
    const std::optional<absl::Status> answer = call->Await(absl::Seconds(30));
    ASSERT_TRUE(answer.has_value());
    EXPECT_TRUE(answer->ok()) << *answer;
  }
  EXPECT_THAT(log.ran(), ::testing::ElementsAre(1, 2, 3));
  ASSERT_TRUE(busy.call().Await(absl::Seconds(30)).has_value());
  executor.Stop();
  EXPECT_EQ(scheduler.held(), 0u);
}

// A soak under faults, bounded: 8 client threads share the seq_ids of 4
// models under a tight budget; every call has a short random deadline (fixed
// seeds) after which its client gives up, and every refused or abandoned
// call is retried with the same seq_id, as the docs prescribe. No client
// leaves a gap, so no window may be poisoned; every seq_id runs once, in
// order, and every call is answered once.
TEST(RequestSchedulerLoadTest, ShortDeadlinesAndRetriesPoisonNoWindow) {
  constexpr int kThreads = 8;
  constexpr uint64_t kSeqIdsPerModel = 200;
  const std::vector<std::string> kModels = {"a", "b", "c", "d"};
  CommandExecutor executor;
  FakeEngine engine;
  std::atomic<int> gap_timeouts{0};
  RequestSchedulerHooks hooks;
  hooks.on_gap_timeout = [&](const std::string&) { ++gap_timeouts; };
  RequestSchedulerOptions options = Options();
  // Far longer than any client waits between tries: only a window the
  // server itself blocked can reach it.
  // A client thread descheduled on a loaded machine must not reach it
  // either.
  options.sequencing.gap_timeout = absl::Seconds(30);
  options.sequencing.cache_size = kSeqIdsPerModel;  // every retry replays
  options.budget = {/*total=*/6, /*per_tenant=*/6, /*per_model=*/2};
  absl::Mutex failures_mu;
  std::vector<std::string> failures;
  std::atomic<int> gave_up{0}, refused{0};
  {
    RequestScheduler scheduler(options, &executor, hooks);
    for (const std::string& id : kModels) {
      ASSERT_TRUE(engine.Create(id, scheduler.sequencer()).ok());
    }
    std::map<std::string, std::atomic<uint64_t>> next_seq;
    for (const std::string& id : kModels) next_seq[id] = 1;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(2000 + t);
        const absl::Time give_up_all = absl::Now() + absl::Seconds(60);
        while (true) {
          const std::string& id = kModels[rng() % kModels.size()];
          const uint64_t seq_id = next_seq.at(id)++;
          if (seq_id > kSeqIdsPerModel) {
            // This model is done; stop once every model is.
            bool all_done = true;
            for (const std::string& m : kModels) {
              all_done = all_done && next_seq.at(m) > kSeqIdsPerModel;
            }
            if (all_done) return;
            continue;
          }
          const absl::Duration work = absl::Microseconds(50 + rng() % 150);
          for (;;) {
            if (absl::Now() > give_up_all) {
              absl::MutexLock lock(&failures_mu);
              failures.push_back(absl::StrCat(id, " seq_id ", seq_id,
                                              " made no progress in 60 s"));
              return;
            }
            Call call(scheduler, id, seq_id, [&engine, id, seq_id, work] {
              absl::SleepFor(work);
              return engine.Train(id, seq_id);
            });
            const absl::Duration deadline =
                absl::Microseconds(200 + rng() % 3000);
            std::optional<absl::Status> answer = call.Await(deadline);
            if (!answer.has_value()) {
              ++gave_up;
              call.GiveUp();
            } else if (answer->ok()) {
              break;
            } else if (absl::IsResourceExhausted(*answer)) {
              ++refused;
            } else if (!absl::IsDeadlineExceeded(*answer)) {
              absl::MutexLock lock(&failures_mu);
              failures.push_back(absl::StrCat(id, " seq_id ", seq_id, ": ",
                                              answer->ToString()));
              break;
            }
            absl::SleepFor(absl::Microseconds(100 + rng() % 400));
          }
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    executor.Stop();
    EXPECT_EQ(scheduler.held(), 0u);
    EXPECT_EQ(scheduler.extra_replies(), 0u);
    for (const std::string& id : kModels) {
      EXPECT_EQ(scheduler.sequencer().NextSeqId(id).value_or(0),
                kSeqIdsPerModel + 1)
          << id;
    }
  }
  EXPECT_THAT(failures, ::testing::IsEmpty());
  EXPECT_EQ(gap_timeouts.load(), 0);
  EXPECT_THAT(engine.violations(), ::testing::IsEmpty());
  std::cout << "clients gave up " << gave_up << " times, refused " << refused
            << " times\n";
}

}  // namespace
}  // namespace tally
