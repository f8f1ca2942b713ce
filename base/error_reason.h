// Why a request failed, as a stable name a client can act on.
//
// A gRPC status code says what kind of failure it was; several causes share a
// code (RESOURCE_EXHAUSTED is a full queue, which a retry fixes, or a message
// that will never fit, which it does not). Library code marks a status with
// its ErrorReason; the gRPC boundary (proto/grpc_status.h) sends it as a
// google.rpc.ErrorInfo, plus a google.rpc.RetryInfo where a retry of the same
// request can succeed, and clients decide from the reason whether to retry.
//
//   return ReasonError(ErrorReason::kQueueFull, "the queue is full");
//   ...
//   if (IsRetryable(status)) RetryLater(RetryDelay(status));
#ifndef TALLY_BASE_ERROR_REASON_H_
#define TALLY_BASE_ERROR_REASON_H_

#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tally {

enum class ErrorReason {
  // RESOURCE_EXHAUSTED: the request budget (total, tenant or model) is full.
  // Retryable: the same request, later.
  kQueueFull,
  // RESOURCE_EXHAUSTED: the request or its response exceeds
  // --max-message-bytes. Never retryable: split the call.
  kMessageTooLarge,
  // RESOURCE_EXHAUSTED: the model or call does not fit the memory budget.
  // Not retryable as is: free memory (delete a model) or shrink the call.
  kMemoryLimit,
  // ABORTED: a sequenced request waited for an earlier seq_id that never came;
  // the window is poisoned. AbortAccumulation, then resend.
  kSeqGap,
  // ABORTED: the model was restored from a checkpoint behind the client's
  // seq_id; resend from ModelInfo.next_seq_id.
  kSeqRestored,
  // ABORTED: the accumulation window is poisoned. AbortAccumulation, then
  // resend the window.
  kWindowPoisoned,
  // ALREADY_EXISTS: the seq_id was used by a request with another payload.
  kSeqIdReused,
  // ALREADY_EXISTS: the seq_id was executed and its response is no longer
  // cached.
  kSeqIdExpired,
  // ALREADY_EXISTS: CreateModel of a model id that exists.
  kModelExists,
  // FAILED_PRECONDITION: a failed step or load may have left the parameters
  // partly updated; LoadCheckpoint to restore them.
  kModelDamaged,
  // UNAVAILABLE: the server is draining or stopping. Retryable, on the
  // restarted server.
  kShuttingDown,
  // UNAVAILABLE: a rank of the server failed; it is restarting. Retryable.
  kRankFailed,
};

// The stable UPPER_SNAKE_CASE name sent as google.rpc.ErrorInfo.reason.
absl::string_view ReasonName(ErrorReason reason);
std::optional<ErrorReason> ReasonFromName(absl::string_view name);

// An error of `reason`'s canonical code (the one named above) and `message`,
// marked with `reason`.
absl::Status ReasonError(ErrorReason reason, absl::string_view message);
// `status` marked with `reason` (an OK status stays OK); for a status whose
// code comes from elsewhere (the wire, a cache).
absl::Status WithReason(absl::Status status, ErrorReason reason);
// The reason `status` was marked with, if any.
std::optional<ErrorReason> ReasonOf(const absl::Status& status);

// Whether retrying the same request (same seq_id) can succeed. A status with
// a reason is retryable iff the reason is; one without (a transport failure,
// a deadline) iff it is UNAVAILABLE or DEADLINE_EXCEEDED.
bool IsRetryable(const absl::Status& status);
// How long to wait before that retry, for a retryable reason.
std::optional<absl::Duration> RetryDelay(ErrorReason reason);

}  // namespace tally

#endif  // TALLY_BASE_ERROR_REASON_H_
