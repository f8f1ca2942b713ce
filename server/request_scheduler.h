// RequestScheduler: the way of one validated request to its one reply,
// without gRPC or the engine.
//
// It takes a slot of the request budget (RESOURCE_EXHAUSTED when full; the
// model's next seq_id gets the model's reserved slot then), queues the
// request's command on the CommandExecutor — at once when unsequenced
// (seq_id 0), through the Sequencer (exactly once, in seq_id order) when
// sequenced —, runs it unless the caller gave up (`precheck`), gives the slot
// back and replies. A sequenced request whose caller gives up while it waits
// is answered and gives its slot back at once (`Withdraw`). While a command
// runs, its `stop_check` is the thread's DecodeControl
// (runtime/sample/decode_control.h): a Sample that is decoding when its caller
// gives up stops within a few steps, and reports its progress to
// `on_decode_progress`. Every request is
// replied to exactly once, whatever happens to its model meanwhile (deleted,
// re-created, restored) or to the server (stopping). A command that throws is
// answered INTERNAL and reported to `on_command_exception` (the service poisons
// that model's window); the process goes on.
//
//   tally::RequestScheduler scheduler(options, &executor, hooks);
//   tally::ScheduledRequest request;
//   request.model_id = "m";
//   request.seq_id = 3;  // 0: unsequenced
//   request.fingerprint = tally::RequestFingerprint(proto_request);
//   request.precheck = [&] { return StillWanted(); };
//   request.run = [&] { return RunOnEngine(); };  // on the executor thread
//   request.save_response = [&] { return response.SerializeAsString(); };
//   request.load_response = [&](const std::string& bytes) {
//     return response.ParseFromString(bytes);
//   };
//   request.reply = [&](const absl::Status& status) { Finish(status); };
//   tally::RequestTicket ticket = scheduler.Schedule(std::move(request));
//   ...  // the client cancelled, or its deadline passed:
//   scheduler.Withdraw(ticket, absl::CancelledError("cancelled"));
#ifndef TALLY_SERVER_REQUEST_SCHEDULER_H_
#define TALLY_SERVER_REQUEST_SCHEDULER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "runtime/sample/decode_control.h"
#include "server/executor.h"
#include "server/request_budget.h"
#include "server/sequencer.h"

namespace tally {

struct ScheduledRequest {
  std::string tenant;    // "" without authentication
  std::string model_id;  // the engine id; "" for a request of no model
  uint64_t seq_id = 0;   // 0: unsequenced
  // Sequenced only: of the request's payload (RequestFingerprint).
  uint64_t fingerprint = 0;
  // Asked right before running: OK, or why the caller no longer wants it
  // run (its answer; the request does not run).
  std::function<absl::Status()> precheck;
  // Runs the command on the executor thread.
  std::function<absl::Status()> run;
  // Polled while `run` runs, by a decode in it (DecodeControl): OK, or why
  // the caller gave up (its answer; the decode stops). Null: never.
  std::function<absl::Status()> stop_check;
  // An OK `run` ended the model's accumulation window (an OptimStep, an
  // AbortAccumulation, a LoadCheckpoint): retry outcomes are kept by window.
  bool closes_window = false;
  // Sequenced only: the response after an OK `run`, as bytes, and back (a
  // retry's reply, or a replay from the outcome cache).
  std::function<std::string()> save_response;
  std::function<bool(const std::string& bytes)> load_response;
  // Called exactly once, never under the scheduler's locks.
  std::function<void(const absl::Status& status)> reply;
};

// Names a scheduled request for RequestScheduler::Withdraw.
struct RequestTicket {
  std::string model_id;
  uint64_t seq_id = 0;
  uint64_t caller_id = 0;  // 0: nothing to withdraw
};

struct RequestSchedulerOptions {
  SequencerOptions sequencing;
  // Requests held at once (waiting, queued or executing), overall, per
  // tenant and per model.
  RequestBudgetLimits budget;
};

// Observers; all optional.
struct RequestSchedulerHooks {
  // How many requests are held, after each change.
  std::function<void(size_t held)> on_held;
  // A command threw `what`; runs on the executor thread before its request
  // is answered INTERNAL, so the client finds the window already poisoned.
  std::function<void(const std::string& model_id, const std::string& what)>
      on_command_exception;
  // The Sequencer's (SequencerHooks): a gap timed out, a duplicate was seen,
  // a gap closed after `seconds`.
  std::function<void(const std::string& model_id)> on_gap_timeout;
  std::function<void(const std::string& model_id)> on_duplicate;
  std::function<void(double seconds)> on_gap_closed;
  // A decode in a command of `model_id` reported its progress (on the
  // executor thread, after each step and at its end).
  std::function<void(const std::string& model_id, const DecodeStats& stats)>
      on_decode_progress;
};

class RequestScheduler {
 public:
  RequestScheduler(RequestSchedulerOptions options, CommandExecutor* executor,
                   RequestSchedulerHooks hooks);
  RequestScheduler(const RequestScheduler&) = delete;
  RequestScheduler& operator=(const RequestScheduler&) = delete;

  // The ticket names a sequenced request for Withdraw; it may have been
  // answered already.
  RequestTicket Schedule(ScheduledRequest request);
  // The caller of `ticket`'s request gave up (`status`: CANCELLED,
  // DEADLINE_EXCEEDED). A sequenced request still waiting for its turn is
  // answered `status` at once, gives its slot back and does not run (its
  // seq_id stays unused, unless a retry joined it); a running, answered or
  // unsequenced one is left alone (its precheck decides at its turn).
  void Withdraw(const RequestTicket& ticket, const absl::Status& status);

  // Models come and go through it (AddModel / RemoveModel / ImportState).
  Sequencer& sequencer() { return sequencer_; }
  const Sequencer& sequencer() const { return sequencer_; }
  // Requests held now: 0 once every scheduled request was replied to.
  size_t held() const { return budget_.held(); }
  // Replies beyond a request's first, refused and logged: 0 unless tally
  // has a bug.
  uint64_t extra_replies() const { return extra_replies_; }

 private:
  // A slot of the budget for `request`: a shared one, or when those are
  // full and the request is its model's next seq_id, the model's reserved
  // one (`*reserved`).
  absl::Status Admit(const ScheduledRequest& request, bool* reserved);
  // `reply` wrapped to give the budget slot back and to refuse a second
  // call.
  std::function<void(const absl::Status&)> ReplyOnce(
      std::string tenant, std::string model_id, bool reserved,
      std::function<void(const absl::Status&)> reply);
  // `request.run`, with an exception turned into INTERNAL, under a
  // DecodeControl of its stop_check and on_decode_progress.
  absl::Status RunGuarded(const ScheduledRequest& request);
  void ScheduleUnsequenced(ScheduledRequest request);
  void ScheduleSequenced(ScheduledRequest request, uint64_t caller_id);

  CommandExecutor* executor_;
  const RequestSchedulerHooks hooks_;
  RequestBudget budget_;
  Sequencer sequencer_;
  std::atomic<uint64_t> extra_replies_{0};
  std::atomic<uint64_t> last_caller_id_{0};
};

}  // namespace tally

#endif  // TALLY_SERVER_REQUEST_SCHEDULER_H_
