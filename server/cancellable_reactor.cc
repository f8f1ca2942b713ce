#include "server/cancellable_reactor.h"

#include <chrono>
#include <utility>

namespace tally {

void CancellableReactor::OnCancelled(std::function<void()> on_cancel) {
  {
    absl::MutexLock lock(&mu_);
    if (!cancelled_) {
      on_cancel_ = std::move(on_cancel);
      return;
    }
  }
  on_cancel();
}

void CancellableReactor::OnCancel() {
  std::function<void()> on_cancel;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    on_cancel = std::move(on_cancel_);
  }
  // Outside the lock: it may finish the call.
  if (on_cancel) on_cancel();
}

// gRPC calls it last, once every other reaction has returned.
void CancellableReactor::OnDone() { delete this; }

absl::Status CallerGaveUpWhileRunning(grpc::CallbackServerContext& context) {
  if (context.deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError(
        "the deadline passed while the request ran: it was stopped");
  }
  if (context.IsCancelled()) {
    return absl::CancelledError(
        "cancelled by the client while the request ran: it was stopped");
  }
  return absl::OkStatus();
}

}  // namespace tally
