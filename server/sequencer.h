// Sequencer: exactly-once, in-order execution of a model's sequenced
// requests.
//
// A mutating request may carry a seq_id (> 0), counted per model from 1.
// The sequencer hands a model's sequenced requests to `dispatch` one at a time
// in seq_id order and executes each seq_id at most once:
//   - a retry of an executed seq_id gets the cached outcome if its payload
//     fingerprint matches, ALREADY_EXISTS naming the seq_id otherwise; a retry
//     of a seq_id that is still waiting or executing joins it and gets the
//     same outcome;
//   - a request ahead of a missing seq_id waits; once the gap has lasted
//     `gap_timeout`, `on_gap_timeout` runs (the caller poisons the window) and
//     every waiting request of the model gets ABORTED;
//   - a caller that gave up before its request ran (see `precheck`) leaves the
//     seq_id unused, so its retry executes it; a caller that gives up while
//     it waits is answered at once through `Withdraw` (and forgotten), not
//     only when its turn comes;
//   - every caller is answered exactly once: removing a model answers its
//     waiting callers NOT_FOUND and forgets them, and work dispatched for a
//     removed model runs nothing. A model's queue is its incarnation: a model
//     removed and added again under the same id starts a new queue, and no
//     request accepted by the old one can run on the new one;
//   - after ImportState (a restored model), a request ahead of the restored
//     next_seq_id is answered ABORTED after `restored_gap_timeout` instead of
//     the full gap timeout: its predecessors were lost with the process.
// It knows nothing of gRPC or the engine: callers supply closures, and the
// state a checkpoint needs (next seq_id and cached outcomes) round-trips
// through SequencerState.
//
//   tally::Sequencer sequencer(options, hooks);  // hooks.dispatch: executor
//   sequencer.AddModel("m");
//   tally::SequencedRequest request;
//   request.seq_id = 1;
//   request.fingerprint = tally::RequestFingerprint(proto_request);
//   request.precheck = [&] { return absl::OkStatus(); };
//   request.execute = [&] { return RunOnEngine(); };  // SequencedOutcome
//   request.reply = [&](const tally::SequencedOutcome& o) { Answer(o); };
//   sequencer.Submit("m", std::move(request));
#ifndef TALLY_SERVER_SEQUENCER_H_
#define TALLY_SERVER_SEQUENCER_H_

#include <google/protobuf/message.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/health.h"

namespace tally {

// What executing a request produced.
struct SequencedOutcome {
  absl::Status status;
  std::string response;  // the serialized response message when OK
  // The request ended an accumulation window (a successful OptimStep, an
  // AbortAccumulation): outcome retention counts windows by it.
  bool closes_window = false;
};

struct SequencedRequest {
  uint64_t seq_id = 0;
  // Of the request's payload (RequestFingerprint): equal for a true retry.
  uint64_t fingerprint = 0;
  // Asked right before execution: OK to run, or why this caller no longer
  // wants its request run (CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE). Such
  // a caller is answered with that status and the seq_id stays unused.
  std::function<absl::Status()> precheck;
  // Executes the request on the dispatch thread. Called at most once per
  // seq_id, for one of the callers that passed `precheck`.
  std::function<SequencedOutcome()> execute;
  // Answers the caller: called exactly once, never under the sequencer's
  // lock.
  std::function<void(const SequencedOutcome&)> reply;
  // Names this caller for `Withdraw`: unique among the Sequencer's callers
  // (0: never withdrawn).
  uint64_t caller_id = 0;
};

struct SequencerOptions {
  // How long a missing seq_id may hold back the requests behind it.
  absl::Duration gap_timeout = absl::Seconds(30);
  // The same for a model restored by ImportState whose restored next_seq_id
  // has not arrived yet: a client ahead of it lost its predecessors with the
  // previous process and is told so soon. Short, not zero, so that a client
  // pipelining from the restored seq_id is not refused for a reordering.
  absl::Duration restored_gap_timeout = absl::Seconds(1);
  // Outcomes kept per model for retries: every seq_id of the current and the
  // previous accumulation window (SequencedOutcome::closes_window), and at
  // least the last `cache_size` seq_ids, ...
  size_t cache_size = 64;
  // ... as long as the kept responses of the model total at most
  // `cache_bytes`; beyond it the oldest outside the last `cache_size` go.
  size_t cache_bytes = size_t{256} << 20;
  // Optional, outlives the Sequencer: the gap timer's loop beats on it as
  // "sequencer" (server/health.h).
  Liveness* liveness = nullptr;
};

// The observers (metrics) are optional; none of the hooks may call back into
// the Sequencer.
struct SequencerHooks {
  // Queues `work` behind everything queued before (the command executor);
  // false when it no longer accepts work.
  std::function<bool(std::function<void()> work)> dispatch;
  // A gap of `model_id` timed out. Runs before its waiting requests are
  // answered ABORTED, so a client reacting to them finds the window poisoned.
  std::function<void(const std::string& model_id)> on_gap_timeout;
  // A retry joined a pending seq_id or was answered from the cache.
  std::function<void(const std::string& model_id)> on_duplicate;
  // How long a gap held requests back, when it closed or timed out.
  std::function<void(double seconds)> on_gap_closed;
};

// A model's sequencing state as a checkpoint stores it (an opaque blob).
struct SequencerState {
  struct Outcome {
    uint64_t seq_id = 0;
    uint64_t fingerprint = 0;
    absl::StatusCode code = absl::StatusCode::kOk;
    std::string message;
    // The status's ErrorReason name (base/error_reason.h), empty for none.
    std::string reason;
    std::string response;
  };
  uint64_t next_seq_id = 1;
  std::vector<Outcome> outcomes;  // ascending seq_id, each < next_seq_id

  std::string Serialize() const;
  // DATA_LOSS for bytes Serialize did not produce (truncated, corrupted).
  static absl::StatusOr<SequencerState> Parse(absl::string_view bytes);
};

// 64-bit fingerprint of `request`'s deterministic serialization; stable
// across processes and builds, so it can be checkpointed.
uint64_t RequestFingerprint(const google::protobuf::Message& request);

class Sequencer {
 public:
  Sequencer(SequencerOptions options, SequencerHooks hooks);
  // Stops (waiting requests get UNAVAILABLE) and joins the gap timer. Work
  // handed to `dispatch` must have run or been dropped before.
  ~Sequencer();
  Sequencer(const Sequencer&) = delete;
  Sequencer& operator=(const Sequencer&) = delete;

  // A new model (or a re-created one) starts at seq_id 1 with no outcomes,
  // in a new incarnation: an existing queue of the id is removed first.
  void AddModel(const std::string& model_id);
  // Its waiting requests get NOT_FOUND, once each; an executing one still
  // finishes and answers its callers; nothing else of it runs.
  void RemoveModel(const std::string& model_id);

  // Answers at once (cached outcome, ALREADY_EXISTS, NOT_FOUND, the Stop
  // status), or queues the request until its turn. request.seq_id > 0.
  void Submit(const std::string& model_id, SequencedRequest request);
  // The caller `caller_id` of `seq_id` gave up (`status`: CANCELLED,
  // DEADLINE_EXCEEDED). If it is still waiting — not yet taken to run — it
  // is answered `status` now and forgotten: a seq_id left without callers
  // does not run (it stays unused for a retry), and requests it held back
  // wait on as before. Otherwise (running, answered, unknown) nothing
  // happens; a running caller gets the outcome.
  void Withdraw(const std::string& model_id, uint64_t seq_id,
                uint64_t caller_id, const absl::Status& status);

  // NOT_FOUND for an unknown model.
  absl::StatusOr<uint64_t> NextSeqId(const std::string& model_id) const;
  absl::StatusOr<SequencerState> ExportState(const std::string& model_id) const;
  // Replaces the model's state (e.g. from a checkpoint); FAILED_PRECONDITION
  // while it has requests waiting or executing, INVALID_ARGUMENT for an
  // inconsistent state.
  absl::Status ImportState(const std::string& model_id, SequencerState state);

  // From now on every waiting and newly submitted request is answered with
  // `status` (UNAVAILABLE at shutdown or after a rank failure); requests
  // already dispatched still run (their precheck decides).
  void Stop(absl::Status status);

 private:
  struct Waiting {
    uint64_t fingerprint = 0;
    std::vector<SequencedRequest> callers;
    // RunNext took callers of it to run: its fingerprint holds even while
    // `callers` (those who joined since) is empty.
    bool running = false;
  };
  struct ModelQueue {
    std::string model_id;
    // Set when the model was removed: its dispatched work runs nothing.
    bool removed = false;
    // Set by ImportState until the restored next_seq_id arrives.
    bool restored = false;
    uint64_t next_seq_id = 1;
    // The first seq_id of the current and of the previous window.
    uint64_t window_start = 1;
    uint64_t previous_window_start = 1;
    size_t cached_bytes = 0;  // of the responses in `outcomes`
    // pending[next_seq_id] has been handed to dispatch and not finished.
    bool dispatched = false;
    std::map<uint64_t, Waiting> pending;  // seq_id >= next_seq_id
    std::map<uint64_t, SequencerState::Outcome> outcomes;  // < next_seq_id
    // When the current gap (requests waiting, next_seq_id missing) opened.
    absl::Time gap_since = absl::InfiniteFuture();
  };
  // Replies collected under the lock and sent after it is released.
  using Replies = std::vector<std::pair<SequencedRequest, SequencedOutcome>>;

  void Advance(const std::shared_ptr<ModelQueue>& queue, Replies& replies)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseGap(ModelQueue& queue) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers every waiting caller of `queue` with `status` and forgets them,
  // except the dispatched seq_id's, whose RunNext answers them.
  static void AnswerWaiting(ModelQueue& queue, const absl::Status& status,
                            Replies& replies);
  // Records an executed seq_id's outcome and drops what retention allows.
  void Remember(ModelQueue& queue, SequencerState::Outcome outcome,
                bool closes_window) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Prune(ModelQueue& queue) const;
  // The ABORTED answer of a request that waited too long for `missing`.
  absl::Status GapTimedOut(const ModelQueue& queue, uint64_t seq_id,
                           uint64_t missing) const;
  // NOT_FOUND naming the model when it has no queue.
  absl::StatusOr<ModelQueue*> FindQueue(const std::string& model_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs on the dispatch thread: executes the queue's next seq_id.
  void RunNext(const std::shared_ptr<ModelQueue>& queue);
  void GapTimerLoop();
  static void Send(Replies& replies);

  const SequencerOptions options_;
  const SequencerHooks hooks_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<ModelQueue>> models_
      ABSL_GUARDED_BY(mu_);
  absl::Status stopped_ ABSL_GUARDED_BY(mu_);
  bool exiting_ ABSL_GUARDED_BY(mu_) = false;
  absl::CondVar gap_changed_;
  const std::unique_ptr<Liveness::Heartbeat> heartbeat_;
  std::thread gap_timer_;
};

}  // namespace tally

#endif  // TALLY_SERVER_SEQUENCER_H_
