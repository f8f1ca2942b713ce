// The RequestScheduler with a real CommandExecutor and a stand-in engine:
// a command that throws is answered INTERNAL without ending the process,
// and a stress of creates, deletes, re-creates, restores and training calls
// (sequenced and unsequenced, duplicated, given up) from many threads answers
// every request exactly once, never runs a request of one incarnation on
// another, and returns the request budget to 0.
#include "server/request_scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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

}  // namespace
}  // namespace tally
