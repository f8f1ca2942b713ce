#include "server/cancellable_reactor.h"

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

}  // namespace tally
