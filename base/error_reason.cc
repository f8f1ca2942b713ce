#include "base/error_reason.h"

#include <array>
#include <string>
#include <utility>

#include "absl/strings/cord.h"

namespace tally {
namespace {

// The absl::Status payload that carries the reason name inside the process.
constexpr absl::string_view kReasonPayload = "tally.v1/error-reason";

struct ReasonEntry {
  ErrorReason reason;
  absl::string_view name;
  // Zero: not retryable.
  absl::Duration retry_delay;
};

constexpr std::array<ReasonEntry, 12> kReasons = {{
    {ErrorReason::kQueueFull, "QUEUE_FULL", absl::Milliseconds(500)},
    {ErrorReason::kMessageTooLarge, "MESSAGE_TOO_LARGE", absl::ZeroDuration()},
    {ErrorReason::kMemoryLimit, "MEMORY_LIMIT", absl::ZeroDuration()},
    {ErrorReason::kSeqGap, "SEQ_GAP", absl::ZeroDuration()},
    {ErrorReason::kSeqRestored, "SEQ_RESTORED", absl::ZeroDuration()},
    {ErrorReason::kWindowPoisoned, "WINDOW_POISONED", absl::ZeroDuration()},
    {ErrorReason::kSeqIdReused, "SEQ_ID_REUSED", absl::ZeroDuration()},
    {ErrorReason::kSeqIdExpired, "SEQ_ID_EXPIRED", absl::ZeroDuration()},
    {ErrorReason::kModelExists, "MODEL_EXISTS", absl::ZeroDuration()},
    {ErrorReason::kModelDamaged, "MODEL_DAMAGED", absl::ZeroDuration()},
    {ErrorReason::kShuttingDown, "SHUTTING_DOWN", absl::Seconds(1)},
    {ErrorReason::kRankFailed, "RANK_FAILED", absl::Seconds(2)},
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
