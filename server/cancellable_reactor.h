// CancellableReactor: a gRPC unary reactor (callback API) that tells its
// owner when the call is cancelled — the client cancelled it, or its
// deadline passed — so a request still waiting for its turn can be answered
// and forgotten at once rather than when its turn comes.
//
//   auto* reactor = new tally::CancellableReactor;  // deletes itself
//   ...  // hand the request on; reactor->Finish(status) exactly once
//   reactor->OnCancelled([=] { scheduler->Withdraw(ticket, why); });
//   return reactor;  // from the handler
//
// CallerGaveUpWhileRunning tells a request that is running (a Sample that
// decodes) that its caller no longer waits, so that it can stop.
#ifndef TALLY_SERVER_CANCELLABLE_REACTOR_H_
#define TALLY_SERVER_CANCELLABLE_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <functional>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace tally {

class CancellableReactor final : public grpc::ServerUnaryReactor {
 public:
  // Runs `on_cancel` once, when gRPC reports the call cancelled, or at once
  // (on this thread) if it already did. Set at most once per call.
  void OnCancelled(std::function<void()> on_cancel);

  void OnCancel() override;
  void OnDone() override;

 private:
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> on_cancel_ ABSL_GUARDED_BY(mu_);
};

// Why the caller of `context`'s running request no longer waits for its
// answer: DEADLINE_EXCEEDED (its deadline passed) or CANCELLED (it
// cancelled), each saying the request was stopped while it ran; OK while it
// waits.
absl::Status CallerGaveUpWhileRunning(grpc::CallbackServerContext& context);

}  // namespace tally

#endif  // TALLY_SERVER_CANCELLABLE_REACTOR_H_
