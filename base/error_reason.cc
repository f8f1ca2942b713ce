#include "base/error_reason.h"

#include <array>
#include <string>
#include <utility>

#include "absl/strings/cord.h"

namespace tally {
namespace {

// The absl::Status payload that carries the reason name inside the process.
constexpr absl::string_view kReasonPayload = "tally.v1/error-reason";

using Code = absl::StatusCode;

struct ReasonEntry {
  ErrorReason reason;
  absl::string_view name;
  Code code;  // the one canonical code of this reason
  // Zero: not retryable.
  absl::Duration retry_delay;
};

constexpr absl::Duration kFinal = absl::ZeroDuration();

constexpr std::array<ReasonEntry, 12> kReasons = {{
    {ErrorReason::kQueueFull, "QUEUE_FULL", Code::kResourceExhausted,
     absl::Milliseconds(500)},
    {ErrorReason::kMessageTooLarge, "MESSAGE_TOO_LARGE",
     Code::kResourceExhausted, kFinal},
    {ErrorReason::kMemoryLimit, "MEMORY_LIMIT", Code::kResourceExhausted,
     kFinal},
    {ErrorReason::kSeqGap, "SEQ_GAP", Code::kAborted, kFinal},
    {ErrorReason::kSeqRestored, "SEQ_RESTORED", Code::kAborted, kFinal},
    {ErrorReason::kWindowPoisoned, "WINDOW_POISONED", Code::kAborted, kFinal},
    {ErrorReason::kSeqIdReused, "SEQ_ID_REUSED", Code::kAlreadyExists, kFinal},
    {ErrorReason::kSeqIdExpired, "SEQ_ID_EXPIRED", Code::kAlreadyExists,
     kFinal},
    {ErrorReason::kModelExists, "MODEL_EXISTS", Code::kAlreadyExists, kFinal},
    {ErrorReason::kModelDamaged, "MODEL_DAMAGED", Code::kFailedPrecondition,
     kFinal},
    {ErrorReason::kShuttingDown, "SHUTTING_DOWN", Code::kUnavailable,
     absl::Seconds(1)},
    {ErrorReason::kRankFailed, "RANK_FAILED", Code::kUnavailable,
     absl::Seconds(2)},
}};

const ReasonEntry& EntryOf(ErrorReason reason) {
  for (const ReasonEntry& entry : kReasons) {
    if (entry.reason == reason) return entry;
  }
  return kReasons[0];  // unreachable: every enumerator has an entry
}

}  // namespace

absl::string_view ReasonName(ErrorReason reason) {
  return EntryOf(reason).name;
}

std::optional<ErrorReason> ReasonFromName(absl::string_view name) {
  for (const ReasonEntry& entry : kReasons) {
    if (entry.name == name) return entry.reason;
  }
  return std::nullopt;
}

absl::Status ReasonError(ErrorReason reason, absl::string_view message) {
  return WithReason(absl::Status(EntryOf(reason).code, message), reason);
}

absl::Status WithReason(absl::Status status, ErrorReason reason) {
  if (!status.ok()) {
    status.SetPayload(kReasonPayload, absl::Cord(ReasonName(reason)));
  }
  return status;
}

std::optional<ErrorReason> ReasonOf(const absl::Status& status) {
  const auto name = status.GetPayload(kReasonPayload);
  if (!name.has_value()) return std::nullopt;
  return ReasonFromName(std::string(*name));
}

bool IsRetryable(const absl::Status& status) {
  if (std::optional<ErrorReason> reason = ReasonOf(status)) {
    return RetryDelay(*reason).has_value();
  }
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

std::optional<absl::Duration> RetryDelay(ErrorReason reason) {
  const absl::Duration delay = EntryOf(reason).retry_delay;
  if (delay == absl::ZeroDuration()) return std::nullopt;
  return delay;
}

}  // namespace tally
