#include "server/request_scheduler.h"

#include <exception>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/error_reason.h"
#include "base/log.h"

namespace tally {

RequestScheduler::RequestScheduler(RequestSchedulerOptions options,
                                   CommandExecutor* executor,
                                   RequestSchedulerHooks hooks)
    : executor_(executor),
      hooks_(std::move(hooks)),
      budget_(options.budget),
      sequencer_(options.sequencing,
                 SequencerHooks{[executor](std::function<void()> work) {
                                  return executor->Submit(std::move(work));
                                },
                                hooks_.on_gap_timeout, hooks_.on_duplicate,
                                hooks_.on_gap_closed}) {}

std::function<void(const absl::Status&)> RequestScheduler::ReplyOnce(
    std::string tenant, std::string model_id, bool reserved,
    std::function<void(const absl::Status&)> reply) {
  auto replied = std::make_shared<std::atomic<bool>>(false);
  return [this, replied, tenant = std::move(tenant),
          model_id = std::move(model_id), reserved,
          reply = std::move(reply)](const absl::Status& status) {
    if (replied->exchange(true)) {
      ++extra_replies_;
      Log(LogLevel::kError,
          absl::StrCat("a request of model '", model_id,
                       "' was answered twice; the second answer (",
                       status.ToString(), ") is dropped"));
      return;
    }
    if (reserved) {
      budget_.ReleaseReserved(model_id);
    } else {
      budget_.Release(tenant, model_id);
    }
    if (hooks_.on_held) hooks_.on_held(budget_.held());
    reply(status);
  };
}

absl::Status RequestScheduler::RunGuarded(const ScheduledRequest& request) {
  // What the command logs names its model and request (its seq_id).
  const LogContext context(
      request.model_id, request.seq_id > 0 ? absl::StrCat(request.seq_id) : "");
  DecodeControl control;
  control.stop = request.stop_check;
  if (hooks_.on_decode_progress) {
    control.on_progress = [this, &request](const DecodeStats& stats) {
      hooks_.on_decode_progress(request.model_id, stats);
    };
  }
  const ScopedDecodeControl installed(&control);
  std::string what;
  try {
    return request.run();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "an exception that is not a std::exception";
  }
  // c10::Error's what() carries a backtrace after the first line.
  if (auto eol = what.find('\n'); eol != std::string::npos) what.resize(eol);
  Log(LogLevel::kError, absl::StrCat("a command of model '", request.model_id,
                                     "' threw: ", what));
  if (hooks_.on_command_exception) {
    hooks_.on_command_exception(request.model_id, what);
  }
  return absl::InternalError(
      absl::StrCat("the server failed while executing this request (", what,
                   "); its accumulation window is poisoned"));
}

absl::Status RequestScheduler::Admit(const ScheduledRequest& request,
                                     bool* reserved) {
  *reserved = false;
  absl::Status admitted = budget_.Acquire(request.tenant, request.model_id);
  // The request every waiting one of its model needs: refusing it could
  // only end in a gap timeout.
  if (!admitted.ok() && request.seq_id > 0 &&
      sequencer_.NextSeqId(request.model_id).value_or(0) == request.seq_id &&
      budget_.AcquireReserved(request.model_id)) {
    *reserved = true;
    return absl::OkStatus();
  }
  return admitted;
}

RequestTicket RequestScheduler::Schedule(ScheduledRequest request) {
  RequestTicket ticket;
  bool reserved = false;
  if (absl::Status admitted = Admit(request, &reserved); !admitted.ok()) {
    request.reply(admitted);
    return ticket;
  }
  if (hooks_.on_held) hooks_.on_held(budget_.held());
  request.reply = ReplyOnce(request.tenant, request.model_id, reserved,
                            std::move(request.reply));
  if (request.seq_id == 0) {
    ScheduleUnsequenced(std::move(request));
    return ticket;
  }
  ticket.model_id = request.model_id;
  ticket.seq_id = request.seq_id;
  ticket.caller_id = ++last_caller_id_;
  ScheduleSequenced(std::move(request), ticket.caller_id);
  return ticket;
}

void RequestScheduler::Withdraw(const RequestTicket& ticket,
                                const absl::Status& status) {
  sequencer_.Withdraw(ticket.model_id, ticket.seq_id, ticket.caller_id, status);
}

void RequestScheduler::ScheduleUnsequenced(ScheduledRequest request) {
  auto shared = std::make_shared<ScheduledRequest>(std::move(request));
  const bool queued = executor_->Submit([this, shared] {
    absl::Status status = shared->precheck();
    if (status.ok()) status = RunGuarded(*shared);
    shared->reply(status);
  });
  if (!queued) {
    shared->reply(
        ReasonError(ErrorReason::kShuttingDown, "the server is shutting down"));
  }
}

void RequestScheduler::ScheduleSequenced(ScheduledRequest request,
                                         uint64_t caller_id) {
  auto shared = std::make_shared<ScheduledRequest>(std::move(request));
  SequencedRequest sequenced;
  sequenced.caller_id = caller_id;
  sequenced.seq_id = shared->seq_id;
  sequenced.fingerprint = shared->fingerprint;
  sequenced.precheck = [shared] { return shared->precheck(); };
  sequenced.execute = [this, shared] {
    SequencedOutcome outcome;
    outcome.status = RunGuarded(*shared);
    if (outcome.status.ok()) {
      outcome.response = shared->save_response();
      outcome.closes_window = shared->closes_window;
    }
    return outcome;
  };
  sequenced.reply = [shared](const SequencedOutcome& outcome) {
    if (outcome.status.ok() && !shared->load_response(outcome.response)) {
      shared->reply(absl::InternalError("cannot parse the cached response"));
      return;
    }
    shared->reply(outcome.status);
  };
  const std::string model_id = shared->model_id;
  sequencer_.Submit(model_id, std::move(sequenced));
}

}  // namespace tally
