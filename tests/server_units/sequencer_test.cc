// The Sequencer without gRPC: ordering, exactly-once execution, retries,
// gaps, callers that gave up, the result cache and its checkpoint state; and
// the RequestBudget that bounds what the server holds.
#include "server/sequencer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/error_reason.h"
#include "server/executor.h"
#include "server/request_budget.h"
#include "tally/v1/trainer.pb.h"

namespace tally {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kModel[] = "m";

// Work handed to `dispatch`, run when the test says so.
class ManualDispatch {
 public:
  bool Dispatch(std::function<void()> work) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(work));
    return true;
  }
  // Runs queued work (and what it queues) until none is left.
  void RunAll() {
    while (true) {
      std::function<void()> work;
      {
        absl::MutexLock lock(&mu_);
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }
  // Runs the oldest queued work alone.
  void RunOne() {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      ASSERT_FALSE(queue_.empty());
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
  size_t queued() const {
    absl::MutexLock lock(&mu_);
    return queue_.size();
  }

 private:
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_;
};

// What the test's "engine" did and what the callers were answered.
class Recorder {
 public:
  // A request whose execution logs `seq_id` and answers "response <tag>" (or
  // `error` when set).
  SequencedRequest Request(uint64_t seq_id, uint64_t fingerprint,
                           const std::string& tag,
                           absl::Status error = absl::OkStatus(),
                           absl::Status precheck = absl::OkStatus()) {
    SequencedRequest request;
    request.seq_id = seq_id;
    request.fingerprint = fingerprint;
    request.precheck = [precheck] { return precheck; };
    request.execute = [this, seq_id, tag, error] {
      absl::MutexLock lock(&mu_);
      executed_.push_back(seq_id);
      return SequencedOutcome{error, error.ok() ? "response " + tag : ""};
    };
    request.reply = [this, tag](const SequencedOutcome& outcome) {
      absl::MutexLock lock(&mu_);
      // A second reply to one caller is a bug the tests must see.
      if (!replies_.emplace(tag, outcome).second) ++extra_replies_;
    };
    return request;
  }
  // Like Request, for a request that ends its window (an OptimStep).
  SequencedRequest WindowEnd(uint64_t seq_id, const std::string& tag) {
    SequencedRequest request = Request(seq_id, seq_id, tag);
    request.execute = [this, seq_id, tag] {
      absl::MutexLock lock(&mu_);
      executed_.push_back(seq_id);
      return SequencedOutcome{absl::OkStatus(), "response " + tag,
                              /*closes_window=*/true};
    };
    return request;
  }
  int extra_replies() const {
    absl::MutexLock lock(&mu_);
    return extra_replies_;
  }

  std::vector<uint64_t> executed() const {
    absl::MutexLock lock(&mu_);
    return executed_;
  }
  size_t num_replies() const {
    absl::MutexLock lock(&mu_);
    return replies_.size();
  }
  // The reply to the caller tagged `tag`; fails the test if there is none.
  SequencedOutcome reply(const std::string& tag) const {
    absl::MutexLock lock(&mu_);
    auto it = replies_.find(tag);
    if (it == replies_.end()) {
      ADD_FAILURE() << "no reply for " << tag;
      return {absl::UnknownError("no reply"), ""};
    }
    return it->second;
  }
  bool replied(const std::string& tag) const {
    absl::MutexLock lock(&mu_);
    return replies_.count(tag) > 0;
  }
  // Waits up to `timeout` for `count` replies.
  bool AwaitReplies(size_t count, absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    auto enough = [&] { return replies_.size() >= count; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<uint64_t> executed_;
  std::map<std::string, SequencedOutcome> replies_;
  int extra_replies_ = 0;
};

class SequencerTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(absl::Seconds(60), 64); }
  void TearDown() override { EXPECT_EQ(recorder_.extra_replies(), 0); }

  void Make(absl::Duration gap_timeout, size_t cache_size,
            absl::Duration restored_gap_timeout = absl::Seconds(60)) {
    sequencer_.reset();
    SequencerOptions options;
    options.gap_timeout = gap_timeout;
    options.cache_size = cache_size;
    options.restored_gap_timeout = restored_gap_timeout;
    SequencerHooks hooks;
    hooks.dispatch = [this](std::function<void()> work) {
      return dispatch_.Dispatch(std::move(work));
    };
    hooks.on_gap_timeout = [this](const std::string& model_id) {
      absl::MutexLock lock(&events_mu_);
      // Runs before the waiting callers hear of it.
      events_.push_back(absl::StrCat("gap timeout ", model_id, " after ",
                                     recorder_.num_replies(), " replies"));
    };
    hooks.on_duplicate = [this](const std::string& model_id) {
      absl::MutexLock lock(&events_mu_);
      events_.push_back("duplicate " + model_id);
    };
    hooks.on_gap_closed = [this](double seconds) {
      absl::MutexLock lock(&events_mu_);
      gap_seconds_.push_back(seconds);
    };
    sequencer_ = std::make_unique<Sequencer>(options, hooks);
    sequencer_->AddModel(kModel);
  }

  void Submit(SequencedRequest request) {
    sequencer_->Submit(kModel, std::move(request));
  }
  uint64_t NextSeqId() { return sequencer_->NextSeqId(kModel).value(); }
  std::vector<std::string> events() {
    absl::MutexLock lock(&events_mu_);
    return events_;
  }
  std::vector<double> gap_seconds() {
    absl::MutexLock lock(&events_mu_);
    return gap_seconds_;
  }

  ManualDispatch dispatch_;
  Recorder recorder_;
  absl::Mutex events_mu_;
  std::vector<std::string> events_;
  std::vector<double> gap_seconds_;
  std::unique_ptr<Sequencer> sequencer_;
};

TEST_F(SequencerTest, ExecutesInSeqIdOrderWhateverTheArrivalOrder) {
  for (uint64_t seq_id : {3, 5, 1, 4, 2}) {
    Submit(recorder_.Request(seq_id, 100 + seq_id, absl::StrCat(seq_id)));
  }
  // Only seq_id 1 is handed over: the rest wait for their predecessors.
  EXPECT_EQ(dispatch_.queued(), 1u);
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1, 2, 3, 4, 5));
  for (uint64_t seq_id = 1; seq_id <= 5; ++seq_id) {
    const SequencedOutcome reply = recorder_.reply(absl::StrCat(seq_id));
    EXPECT_TRUE(reply.status.ok()) << reply.status;
    EXPECT_EQ(reply.response, absl::StrCat("response ", seq_id));
  }
  EXPECT_EQ(NextSeqId(), 6u);
  // The gap before 1 closed without timing out.
  EXPECT_THAT(events(), ::testing::IsEmpty());
}

TEST_F(SequencerTest, RetryOfAnExecutedSeqIdGetsTheCachedOutcomeOnly) {
  Submit(recorder_.Request(1, 7, "first"));
  dispatch_.RunAll();
  Submit(recorder_.Request(1, 7, "retry"));
  // Answered at once, from the cache: nothing was dispatched or executed.
  EXPECT_EQ(dispatch_.queued(), 0u);
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
  EXPECT_EQ(recorder_.reply("retry").response, "response first");
  EXPECT_TRUE(recorder_.reply("retry").status.ok());
  EXPECT_EQ(NextSeqId(), 2u);
  EXPECT_THAT(events(), ElementsAre("duplicate m"));
}

TEST_F(SequencerTest, DifferentPayloadUnderAUsedSeqIdIsAlreadyExists) {
  Submit(recorder_.Request(1, 7, "executed"));
  dispatch_.RunAll();
  Submit(recorder_.Request(1, 8, "other payload"));
  EXPECT_EQ(recorder_.reply("other payload").status.code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(recorder_.reply("other payload").status.message(),
              HasSubstr("seq_id 1 "));

  Submit(recorder_.Request(3, 30, "waiting"));
  Submit(recorder_.Request(3, 31, "clash"));
  EXPECT_EQ(recorder_.reply("clash").status.code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(recorder_.reply("clash").status.message(),
              HasSubstr("seq_id 3 "));
  Submit(recorder_.Request(2, 20, "2"));
  dispatch_.RunAll();
  // The first payload under 3 is the one that ran.
  EXPECT_THAT(recorder_.executed(), ElementsAre(1, 2, 3));
  EXPECT_EQ(recorder_.reply("waiting").response, "response waiting");
}

TEST_F(SequencerTest, RetriesOfAWaitingOrExecutingSeqIdShareOneExecution) {
  Submit(recorder_.Request(2, 20, "2"));
  Submit(recorder_.Request(2, 20, "2 again"));  // joins the waiting one
  Submit(recorder_.Request(1, 10, "1"));
  ASSERT_EQ(dispatch_.queued(), 1u);
  // A retry of 1 arriving while 1 is dispatched joins it too.
  Submit(recorder_.Request(1, 10, "1 again"));
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1, 2));
  EXPECT_EQ(recorder_.reply("1 again").response, "response 1");
  EXPECT_EQ(recorder_.reply("2 again").response, "response 2");
  EXPECT_EQ(recorder_.reply("2").response, "response 2");
  EXPECT_THAT(events(), ElementsAre("duplicate m", "duplicate m"));
}

TEST_F(SequencerTest, AFailedExecutionIsAnOutcomeAndIsNotRetried) {
  Submit(recorder_.Request(1, 10, "bad", absl::InvalidArgumentError("nope")));
  dispatch_.RunAll();
  Submit(recorder_.Request(1, 10, "bad retry"));
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
  EXPECT_EQ(recorder_.reply("bad").status, absl::InvalidArgumentError("nope"));
  EXPECT_EQ(recorder_.reply("bad retry").status,
            absl::InvalidArgumentError("nope"));
  EXPECT_EQ(NextSeqId(), 2u);
}

TEST_F(SequencerTest, ACallerThatGaveUpLeavesItsSeqIdForTheRetry) {
  Submit(recorder_.Request(1, 10, "cancelled", absl::OkStatus(),
                           absl::CancelledError("client gave up")));
  Submit(recorder_.Request(2, 20, "2"));
  dispatch_.RunAll();
  EXPECT_EQ(recorder_.reply("cancelled").status.code(),
            absl::StatusCode::kCancelled);
  EXPECT_THAT(recorder_.executed(), ::testing::IsEmpty());
  EXPECT_EQ(NextSeqId(), 1u);
  EXPECT_FALSE(recorder_.replied("2"));  // still waiting for 1

  Submit(recorder_.Request(1, 10, "retry"));
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1, 2));
  EXPECT_EQ(recorder_.reply("retry").response, "response retry");
  EXPECT_EQ(recorder_.reply("2").response, "response 2");
}

TEST_F(SequencerTest, ALiveRetryRunsWhenTheFirstCallerGaveUp) {
  Submit(recorder_.Request(1, 10, "expired", absl::OkStatus(),
                           absl::DeadlineExceededError("too late")));
  Submit(recorder_.Request(1, 10, "retry"));
  dispatch_.RunAll();
  EXPECT_EQ(recorder_.reply("expired").status.code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
  EXPECT_EQ(recorder_.reply("retry").response, "response retry");
}

// `request` as the caller `caller_id` (for Withdraw).
SequencedRequest As(uint64_t caller_id, SequencedRequest request) {
  request.caller_id = caller_id;
  return request;
}

TEST_F(SequencerTest, AWithdrawnWaiterIsAnsweredAtOnceAndItsSeqIdStaysUnused) {
  Submit(As(21, recorder_.Request(2, 20, "2")));
  Submit(As(31, recorder_.Request(3, 30, "3")));
  const absl::Status gone = absl::DeadlineExceededError("deadline passed");
  sequencer_->Withdraw(kModel, 2, 21, gone);
  // Answered now, not when its turn comes; 3 still waits for 1 and 2.
  EXPECT_EQ(recorder_.reply("2").status, gone);
  EXPECT_FALSE(recorder_.replied("3"));
  // Withdrawing again, or a caller that is not there, changes nothing.
  sequencer_->Withdraw(kModel, 2, 21, gone);
  sequencer_->Withdraw(kModel, 3, 99, gone);
  sequencer_->Withdraw("unknown", 3, 31, gone);
  EXPECT_FALSE(recorder_.replied("3"));

  // Unused: a different payload may take seq_id 2 now.
  Submit(As(22, recorder_.Request(2, 25, "2 other")));
  Submit(As(11, recorder_.Request(1, 10, "1")));
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1, 2, 3));
  EXPECT_EQ(recorder_.reply("2 other").response, "response 2 other");
  EXPECT_EQ(recorder_.reply("3").response, "response 3");
  EXPECT_THAT(events(), ::testing::IsEmpty());  // no duplicate, no timeout
}

TEST_F(SequencerTest, AWithdrawnDispatchedSeqIdRunsNothingUntilItsRetry) {
  Submit(As(11, recorder_.Request(1, 10, "1")));
  Submit(As(21, recorder_.Request(2, 20, "2")));
  ASSERT_EQ(dispatch_.queued(), 1u);  // 1 is handed to the executor
  sequencer_->Withdraw(kModel, 1, 11, absl::CancelledError("cancelled"));
  EXPECT_EQ(recorder_.reply("1").status.code(), absl::StatusCode::kCancelled);
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ::testing::IsEmpty());
  EXPECT_EQ(NextSeqId(), 1u);
  EXPECT_FALSE(recorder_.replied("2"));

  // The retry, sent as the docs say, runs it once; 2 follows.
  Submit(As(12, recorder_.Request(1, 10, "1 retry")));
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1, 2));
  EXPECT_EQ(recorder_.reply("1 retry").response, "response 1 retry");
  EXPECT_EQ(recorder_.reply("2").response, "response 2");
}

TEST_F(SequencerTest, ARetryThatJoinedAWithdrawnCallerGetsTheOneExecution) {
  Submit(As(11, recorder_.Request(1, 10, "1")));
  Submit(As(12, recorder_.Request(1, 10, "1 joined")));
  sequencer_->Withdraw(kModel, 1, 11, absl::CancelledError("cancelled"));
  // Joined while 1 was dispatched but before the first caller withdrew:
  // the seq_id still runs, once, for the one left.
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
  EXPECT_EQ(recorder_.reply("1").status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(recorder_.reply("1 joined").response, "response 1 joined");
}

TEST_F(SequencerTest, ARunningRequestCannotBeWithdrawn) {
  std::function<void()> withdraw_while_running;
  SequencedRequest running = As(11, recorder_.Request(1, 10, "1"));
  SequencedRequest joined = As(12, recorder_.Request(1, 10, "1 joined"));
  auto execute = running.execute;
  running.execute = [&, execute] {
    // Both callers give up while it executes: it completes, its outcome is
    // cached, and both are answered with it.
    sequencer_->Withdraw(kModel, 1, 11, absl::CancelledError("cancelled"));
    Submit(std::move(joined));
    sequencer_->Withdraw(kModel, 1, 12, absl::CancelledError("cancelled"));
    // Taken while it runs, though no caller waits on it now.
    Submit(As(14, recorder_.Request(1, 15, "1 other")));
    return execute();
  };
  Submit(std::move(running));
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
  EXPECT_EQ(recorder_.reply("1").response, "response 1");
  // A caller that joined the running seq_id was withdrawn: answered at once
  // (the outcome stays cached for its retry).
  EXPECT_EQ(recorder_.reply("1 joined").status.code(),
            absl::StatusCode::kCancelled);
  Submit(As(13, recorder_.Request(1, 10, "1 retry")));
  EXPECT_EQ(recorder_.reply("1 retry").response, "response 1");
  EXPECT_EQ(recorder_.reply("1 other").status.code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(NextSeqId(), 2u);
}

TEST_F(SequencerTest, WithdrawingEveryWaiterBehindAGapClosesIt) {
  Submit(As(31, recorder_.Request(3, 30, "3")));
  Submit(As(41, recorder_.Request(4, 40, "4")));
  EXPECT_THAT(gap_seconds(), ::testing::IsEmpty());
  sequencer_->Withdraw(kModel, 3, 31, absl::CancelledError("cancelled"));
  EXPECT_THAT(gap_seconds(), ::testing::IsEmpty());  // 4 still waits
  sequencer_->Withdraw(kModel, 4, 41, absl::CancelledError("cancelled"));
  EXPECT_EQ(gap_seconds().size(), 1u);  // nothing waits: no gap to time out
  EXPECT_EQ(recorder_.num_replies(), 2u);
  EXPECT_THAT(events(), ::testing::IsEmpty());
}

TEST_F(SequencerTest, AGapThatTimesOutAbortsEveryWaitingRequest) {
  Make(absl::Milliseconds(100), 64);
  const absl::Time start = absl::Now();
  Submit(recorder_.Request(2, 20, "2"));
  Submit(recorder_.Request(4, 40, "4"));
  ASSERT_TRUE(recorder_.AwaitReplies(2, absl::Seconds(30)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  for (const char* tag : {"2", "4"}) {
    const SequencedOutcome reply = recorder_.reply(tag);
    EXPECT_EQ(reply.status.code(), absl::StatusCode::kAborted);
    EXPECT_THAT(reply.status.message(), HasSubstr("for seq_id 1,"));
    EXPECT_THAT(reply.status.message(), HasSubstr("poisoned"));
  }
  EXPECT_THAT(recorder_.executed(), ::testing::IsEmpty());
  // The window was reported before any waiting caller heard of it.
  EXPECT_THAT(events(), ElementsAre("gap timeout m after 0 replies"));
  ASSERT_EQ(gap_seconds().size(), 1u);
  EXPECT_GE(gap_seconds()[0], 0.1);
  // Nothing was skipped: the client resumes at the missing seq_id.
  EXPECT_EQ(NextSeqId(), 1u);
  Submit(recorder_.Request(1, 10, "1"));
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
}

TEST_F(SequencerTest, WaitingBehindAnExecutingPredecessorIsNoGap) {
  Make(absl::Milliseconds(50), 64);
  Submit(recorder_.Request(1, 10, "1"));  // dispatched, not yet run
  Submit(recorder_.Request(2, 20, "2"));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(recorder_.num_replies(), 0u);
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1, 2));
  EXPECT_TRUE(recorder_.reply("2").status.ok());
  EXPECT_THAT(events(), ::testing::IsEmpty());
}

// Retries stay answerable for every seq_id of the current and the previous
// window, however long; older ones only within the last `cache_size`.
TEST_F(SequencerTest, KeepsTheCurrentAndPreviousWindowsOutcomes) {
  Make(absl::Seconds(60), 2);
  // Window 1: seq 1-4 closed by 5; window 2: 6-8 closed by 9; window 3: 10.
  for (uint64_t seq_id = 1; seq_id <= 10; ++seq_id) {
    const std::string tag = absl::StrCat(seq_id);
    Submit(seq_id % 4 == 1 && seq_id > 1
               ? recorder_.WindowEnd(seq_id, tag)
               : recorder_.Request(seq_id, seq_id, tag));
  }
  dispatch_.RunAll();
  for (uint64_t seq_id = 6; seq_id <= 10; ++seq_id) {
    const std::string tag = absl::StrCat("retry ", seq_id);
    Submit(recorder_.Request(seq_id, seq_id, tag));
    EXPECT_EQ(recorder_.reply(tag).response, absl::StrCat("response ", seq_id))
        << tag;
  }
  Submit(recorder_.Request(5, 5, "retry 5"));
  EXPECT_EQ(recorder_.reply("retry 5").status.code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(recorder_.reply("retry 5").status.message(),
              HasSubstr("no longer cached"));
  EXPECT_EQ(recorder_.executed().size(), 10u);
}

// Without window ends, the last `cache_size` are kept once the responses
// pass `cache_bytes`.
TEST_F(SequencerTest, CachedResponsesAreBoundedByBytes) {
  sequencer_.reset();
  SequencerOptions options;
  options.cache_size = 2;
  options.cache_bytes = 30;  // "response N" is 10 bytes: three fit
  SequencerHooks hooks;
  hooks.dispatch = [this](std::function<void()> work) {
    return dispatch_.Dispatch(std::move(work));
  };
  sequencer_ = std::make_unique<Sequencer>(options, hooks);
  sequencer_->AddModel(kModel);
  for (uint64_t seq_id = 1; seq_id <= 6; ++seq_id) {
    Submit(recorder_.Request(seq_id, seq_id, absl::StrCat(seq_id)));
  }
  dispatch_.RunAll();
  const SequencerState state = sequencer_->ExportState(kModel).value();
  std::vector<uint64_t> kept;
  for (const SequencerState::Outcome& outcome : state.outcomes) {
    kept.push_back(outcome.seq_id);
  }
  EXPECT_THAT(kept, ElementsAre(4, 5, 6));
}

TEST_F(SequencerTest, UnknownAndDeletedModelsAreNotFound) {
  sequencer_->Submit("nope", recorder_.Request(1, 1, "unknown"));
  EXPECT_EQ(recorder_.reply("unknown").status.code(),
            absl::StatusCode::kNotFound);
  Submit(recorder_.Request(2, 2, "waiting"));
  sequencer_->RemoveModel(kModel);
  EXPECT_EQ(recorder_.reply("waiting").status.code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(sequencer_->NextSeqId(kModel).status().code(),
            absl::StatusCode::kNotFound);
  // Re-created, it starts over.
  sequencer_->AddModel(kModel);
  EXPECT_EQ(NextSeqId(), 1u);
}

// DeleteModel while requests wait behind an executing one: each waiting
// caller is answered NOT_FOUND once and forgotten; what was already handed
// to the executor for the deleted model runs nothing.
TEST_F(SequencerTest, RemovingAModelAnswersEachWaiterOnceAndRunsNothingMore) {
  Submit(recorder_.Request(1, 1, "1"));
  Submit(recorder_.Request(2, 2, "2"));
  Submit(recorder_.Request(3, 3, "3"));
  Submit(recorder_.Request(3, 3, "3 retry"));
  dispatch_.RunOne();  // seq 1 runs and hands seq 2 to the executor
  ASSERT_EQ(dispatch_.queued(), 1u);
  sequencer_->RemoveModel(kModel);
  for (const char* tag : {"3", "3 retry"}) {
    EXPECT_EQ(recorder_.reply(tag).status.code(), absl::StatusCode::kNotFound)
        << tag;
  }
  dispatch_.RunAll();
  EXPECT_EQ(recorder_.reply("2").status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(recorder_.reply("2").status.message(), HasSubstr("deleted"));
  EXPECT_TRUE(recorder_.reply("1").status.ok());
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
  EXPECT_EQ(recorder_.num_replies(), 4u);
}

// The model deleted by the request executing now (as DeleteModel does on
// the executor): the executing one is answered with its outcome, the rest
// NOT_FOUND, each once.
TEST_F(SequencerTest, RemovingTheModelWhileARequestExecutes) {
  SequencedRequest deleting = recorder_.Request(1, 1, "1");
  deleting.execute = [this, execute = deleting.execute] {
    sequencer_->RemoveModel(kModel);
    return execute();
  };
  Submit(std::move(deleting));
  Submit(recorder_.Request(2, 2, "2"));
  dispatch_.RunAll();
  EXPECT_TRUE(recorder_.reply("1").status.ok());
  EXPECT_EQ(recorder_.reply("2").status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
  EXPECT_EQ(dispatch_.queued(), 0u);
}

// Deleted and re-created under the same id while seq 2 waits: seq 2 never
// runs on the new model, which starts its own sequence at 1.
TEST_F(SequencerTest, AReCreatedModelRunsNothingQueuedForTheOldOne) {
  Submit(recorder_.Request(1, 1, "old 1"));
  Submit(recorder_.Request(2, 2, "old 2"));
  dispatch_.RunOne();  // old seq 1 runs; old seq 2 is handed over
  sequencer_->RemoveModel(kModel);
  sequencer_->AddModel(kModel);
  Submit(recorder_.Request(1, 10, "new 1"));
  Submit(recorder_.Request(2, 20, "new 2"));
  dispatch_.RunAll();
  EXPECT_EQ(recorder_.reply("old 2").status.code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(recorder_.reply("new 1").response, "response new 1");
  EXPECT_EQ(recorder_.reply("new 2").response, "response new 2");
  EXPECT_THAT(recorder_.executed(), ElementsAre(1, 1, 2));
  EXPECT_EQ(NextSeqId(), 3u);
}

// AddModel over a live id replaces its incarnation the same way.
TEST_F(SequencerTest, AddingAnExistingIdStartsANewIncarnation) {
  Submit(recorder_.Request(2, 2, "old 2"));  // waits for seq 1
  sequencer_->AddModel(kModel);
  EXPECT_EQ(recorder_.reply("old 2").status.code(),
            absl::StatusCode::kNotFound);
  Submit(recorder_.Request(1, 1, "new 1"));
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
}

// After a restore (ImportState), a request ahead of the restored
// next_seq_id is told soon, without poisoning anything: its predecessors
// were lost with the previous process. Once the restored seq_id ran, gaps
// wait the full timeout again.
TEST_F(SequencerTest, ARequestAheadOfARestoredSequenceIsAnsweredSoon) {
  Make(absl::Seconds(60), 64, absl::Milliseconds(50));
  SequencerState restored;
  restored.next_seq_id = 5;
  ASSERT_TRUE(sequencer_->ImportState(kModel, restored).ok());
  Submit(recorder_.Request(7, 7, "7"));
  ASSERT_TRUE(recorder_.AwaitReplies(1, absl::Seconds(20)));
  const absl::Status ahead = recorder_.reply("7").status;
  EXPECT_EQ(ahead.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(ahead.message(), HasSubstr("restored"));
  EXPECT_THAT(ahead.message(), HasSubstr("resend the window from seq_id 5"));
  EXPECT_THAT(events(), ::testing::IsEmpty());  // nothing poisoned
  EXPECT_EQ(NextSeqId(), 5u);

  Submit(recorder_.Request(5, 5, "5"));
  dispatch_.RunAll();
  EXPECT_TRUE(recorder_.reply("5").status.ok());
  Submit(recorder_.Request(7, 7, "7 again"));  // seq 6 is missing: a gap
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(recorder_.replied("7 again"));
  sequencer_->RemoveModel(kModel);
  EXPECT_EQ(recorder_.reply("7 again").status.code(),
            absl::StatusCode::kNotFound);
}

TEST_F(SequencerTest, StopAnswersWaitingAndLaterRequests) {
  Submit(recorder_.Request(1, 1, "dispatched"));
  Submit(recorder_.Request(3, 3, "waiting"));
  sequencer_->Stop(absl::UnavailableError("bye"));
  EXPECT_EQ(recorder_.reply("waiting").status, absl::UnavailableError("bye"));
  Submit(recorder_.Request(2, 2, "late"));
  EXPECT_EQ(recorder_.reply("late").status, absl::UnavailableError("bye"));
  // The dispatched one still runs (its precheck decides).
  dispatch_.RunAll();
  EXPECT_THAT(recorder_.executed(), ElementsAre(1));
}

TEST_F(SequencerTest, StateRoundTripsAndResumesExactlyOnce) {
  Submit(recorder_.Request(1, 11, "1"));
  // An outcome's ErrorReason is part of it: the replay after a restart
  // carries it too.
  const absl::Status refused = WithReason(absl::FailedPreconditionError("no"),
                                          ErrorReason::kModelDamaged);
  Submit(recorder_.Request(2, 22, "2", refused));
  Submit(recorder_.Request(3, 33, "3"));
  dispatch_.RunAll();
  const SequencerState exported = sequencer_->ExportState(kModel).value();
  EXPECT_EQ(exported.next_seq_id, 4u);
  ASSERT_EQ(exported.outcomes.size(), 3u);
  const std::string bytes = exported.Serialize();
  const absl::StatusOr<SequencerState> parsed = SequencerState::Parse(bytes);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->next_seq_id, 4u);
  ASSERT_EQ(parsed->outcomes.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(parsed->outcomes[i].seq_id, exported.outcomes[i].seq_id);
    EXPECT_EQ(parsed->outcomes[i].fingerprint,
              exported.outcomes[i].fingerprint);
    EXPECT_EQ(parsed->outcomes[i].code, exported.outcomes[i].code);
    EXPECT_EQ(parsed->outcomes[i].message, exported.outcomes[i].message);
    EXPECT_EQ(parsed->outcomes[i].reason, exported.outcomes[i].reason);
    EXPECT_EQ(parsed->outcomes[i].response, exported.outcomes[i].response);
  }

  // A restarted server: a fresh sequencer fed the parsed state.
  Make(absl::Seconds(60), 64);
  ASSERT_TRUE(sequencer_->ImportState(kModel, *parsed).ok());
  EXPECT_EQ(NextSeqId(), 4u);
  Submit(recorder_.Request(3, 33, "3 after restart"));
  Submit(recorder_.Request(2, 22, "2 after restart"));
  Submit(recorder_.Request(4, 44, "4"));
  dispatch_.RunAll();
  EXPECT_EQ(recorder_.reply("3 after restart").response, "response 3");
  EXPECT_EQ(exported.outcomes[1].reason, "MODEL_DAMAGED");
  EXPECT_EQ(recorder_.reply("2 after restart").status, refused);
  EXPECT_EQ(ReasonOf(recorder_.reply("2 after restart").status),
            ErrorReason::kModelDamaged);
  EXPECT_EQ(recorder_.reply("4").response, "response 4");
  EXPECT_THAT(recorder_.executed(), ElementsAre(1, 2, 3, 4));
}

TEST_F(SequencerTest, DamagedOrInconsistentStateIsRefused) {
  Submit(recorder_.Request(1, 11, "1"));
  dispatch_.RunAll();
  const std::string bytes = sequencer_->ExportState(kModel).value().Serialize();
  for (size_t size = 0; size < bytes.size(); ++size) {
    EXPECT_EQ(SequencerState::Parse(bytes.substr(0, size)).status().code(),
              absl::StatusCode::kDataLoss)
        << "prefix of " << size << " bytes";
  }
  EXPECT_EQ(SequencerState::Parse(bytes + "x").status().code(),
            absl::StatusCode::kDataLoss);
  std::string bad_magic = bytes;
  bad_magic[0] = 'X';
  EXPECT_EQ(SequencerState::Parse(bad_magic).status().code(),
            absl::StatusCode::kDataLoss);

  SequencerState inconsistent;
  inconsistent.next_seq_id = 2;
  inconsistent.outcomes.push_back({5, 1, absl::StatusCode::kOk, "", "", ""});
  EXPECT_EQ(sequencer_->ImportState(kModel, inconsistent).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SequencerState::Parse(inconsistent.Serialize()).status().code(),
            absl::StatusCode::kDataLoss);
  Submit(recorder_.Request(3, 33, "waiting"));
  EXPECT_EQ(sequencer_->ImportState(kModel, SequencerState()).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(RequestFingerprintTest, SameForEqualPayloadsDifferentOtherwise) {
  v1::ForwardBackwardRequest request;
  request.set_model_id("m");
  request.set_seq_id(3);
  v1::Sample* sample = request.add_samples();
  for (int token : {1, 2, 3}) sample->add_input_tokens(token);
  for (int token : {2, 3, 4}) sample->add_target_tokens(token);
  v1::ForwardBackwardRequest copy;
  ASSERT_TRUE(copy.ParseFromString(request.SerializeAsString()));
  EXPECT_EQ(RequestFingerprint(copy), RequestFingerprint(request));

  std::vector<uint64_t> fingerprints = {RequestFingerprint(request)};
  v1::ForwardBackwardRequest changed = request;
  changed.mutable_samples(0)->set_target_tokens(2, 5);
  fingerprints.push_back(RequestFingerprint(changed));
  changed = request;
  changed.set_forward_only(true);
  fingerprints.push_back(RequestFingerprint(changed));
  changed = request;
  changed.mutable_samples(0)->add_weights(1.0f);
  fingerprints.push_back(RequestFingerprint(changed));
  std::sort(fingerprints.begin(), fingerprints.end());
  EXPECT_EQ(std::unique(fingerprints.begin(), fingerprints.end()),
            fingerprints.end());
}

// Many threads send a shuffled mix of seq_ids and retries through a real
// executor: each seq_id runs once, in order, and every caller gets its
// seq_id's response.
TEST(SequencerConcurrencyTest, ShuffledRetriesFromManyThreadsRunOnceInOrder) {
  constexpr uint64_t kRequests = 300;
  constexpr int kThreads = 8;
  CommandExecutor executor;
  Recorder recorder;
  SequencerHooks hooks;
  hooks.dispatch = [&](std::function<void()> work) {
    return executor.Submit(std::move(work));
  };
  std::vector<std::vector<uint64_t>> per_thread(kThreads);
  std::mt19937 rng(5);
  for (uint64_t seq_id = 1; seq_id <= kRequests; ++seq_id) {
    // Sent once or twice, by random threads.
    for (int copy = 0; copy < 1 + static_cast<int>(seq_id % 2); ++copy) {
      per_thread[rng() % kThreads].push_back(seq_id);
    }
  }
  size_t total = 0;
  for (auto& sends : per_thread) {
    std::shuffle(sends.begin(), sends.end(), rng);
    total += sends.size();
  }
  {
    Sequencer sequencer(SequencerOptions(), hooks);
    sequencer.AddModel(kModel);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        int copy = 0;
        for (uint64_t seq_id : per_thread[t]) {
          sequencer.Submit(kModel, recorder.Request(seq_id, seq_id * 7,
                                                    absl::StrCat(seq_id, "/", t,
                                                                 "/", copy++)));
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    ASSERT_TRUE(recorder.AwaitReplies(total, absl::Seconds(60)));
    executor.Stop();
  }
  std::vector<uint64_t> expected(kRequests);
  std::iota(expected.begin(), expected.end(), 1);
  EXPECT_EQ(recorder.executed(), expected);
  for (int t = 0; t < kThreads; ++t) {
    int copy = 0;
    for (uint64_t seq_id : per_thread[t]) {
      const std::string tag = absl::StrCat(seq_id, "/", t, "/", copy++);
      const SequencedOutcome reply = recorder.reply(tag);
      ASSERT_TRUE(reply.status.ok()) << tag << ": " << reply.status;
      // Whichever copy ran, its response names the same seq_id.
      EXPECT_THAT(reply.response,
                  ::testing::StartsWith(absl::StrCat("response ", seq_id, "/")))
          << tag;
    }
  }
}

TEST(RequestBudgetTest, BoundsTheTotalEachTenantAndEachModel) {
  RequestBudget budget({/*total=*/4, /*per_tenant=*/3, /*per_model=*/2});
  EXPECT_TRUE(budget.Acquire("", "a").ok());
  EXPECT_TRUE(budget.Acquire("", "a").ok());
  const absl::Status third_a = budget.Acquire("", "a");
  EXPECT_EQ(third_a.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third_a.message(), HasSubstr("--max-queued-requests-per-model"));
  EXPECT_TRUE(budget.Acquire("", "").ok());  // no model: only the total
  budget.Release("", "a");
  budget.Release("", "a");
  budget.Release("", "");
  EXPECT_EQ(budget.held(), 0u);

  // One tenant fills its share (behind a gap, say); another still gets in.
  EXPECT_TRUE(budget.Acquire("alice", "alice/m").ok());
  EXPECT_TRUE(budget.Acquire("alice", "alice/n").ok());
  EXPECT_TRUE(budget.Acquire("alice", "").ok());
  const absl::Status alice = budget.Acquire("alice", "alice/o");
  EXPECT_EQ(alice.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(alice.message(), HasSubstr("--max-queued-requests-per-tenant"));
  EXPECT_TRUE(budget.Acquire("bob", "bob/m").ok());
  const absl::Status full = budget.Acquire("carol", "");
  EXPECT_THAT(full.message(), HasSubstr("--max-queued-requests)"));
  budget.Release("alice", "alice/m");
  budget.Release("alice", "alice/n");
  budget.Release("alice", "");
  budget.Release("bob", "bob/m");
  EXPECT_EQ(budget.held(), 0u);
  EXPECT_TRUE(budget.Acquire("alice", "alice/m").ok());
}

TEST(RequestBudgetTest, EachModelHasOneReservedSlotBeyondEveryLimit) {
  RequestBudget budget({/*total=*/1, /*per_tenant=*/1, /*per_model=*/1});
  ASSERT_TRUE(budget.Acquire("alice", "alice/m").ok());
  EXPECT_EQ(budget.Acquire("alice", "alice/m").code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(budget.AcquireReserved("alice/m"));
  EXPECT_FALSE(budget.AcquireReserved("alice/m"));  // one per model
  EXPECT_TRUE(budget.AcquireReserved("alice/n"));
  EXPECT_EQ(budget.held(), 3u);
  budget.ReleaseReserved("alice/m");
  EXPECT_TRUE(budget.AcquireReserved("alice/m"));
  budget.ReleaseReserved("alice/m");
  budget.ReleaseReserved("alice/n");
  budget.Release("alice", "alice/m");
  EXPECT_EQ(budget.held(), 0u);
}

}  // namespace
}  // namespace tally
