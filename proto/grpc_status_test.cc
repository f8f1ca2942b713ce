// ErrorReason and its gRPC form: every reason survives the trip through
// google.rpc rich error details, RetryInfo is sent exactly for the reasons a
// retry can fix, and what a client cannot trust (other domains, garbage
// details, no details) falls back to the status code alone.
#include "base/error_reason.h"

#include <iterator>
#include <set>
#include <string>
#include <utility>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"

namespace tally {
namespace {

constexpr ErrorReason kAllReasons[] = {
    ErrorReason::kQueueFull,    ErrorReason::kMessageTooLarge,
    ErrorReason::kMemoryLimit,  ErrorReason::kSeqGap,
    ErrorReason::kSeqRestored,  ErrorReason::kWindowPoisoned,
    ErrorReason::kSeqIdReused,  ErrorReason::kSeqIdExpired,
    ErrorReason::kModelExists,  ErrorReason::kModelDamaged,
    ErrorReason::kShuttingDown, ErrorReason::kRankFailed};

google::rpc::Status DetailsOf(const grpc::Status& status) {
  google::rpc::Status details;
  EXPECT_TRUE(details.ParseFromString(status.error_details()));
  return details;
}

TEST(ErrorReasonTest, EveryReasonRoundTripsThroughRichErrorDetails) {
  for (ErrorReason reason : kAllReasons) {
    const absl::Status sent =
        WithReason(absl::ResourceExhaustedError("why"), reason);
    const grpc::Status wire = ToGrpcStatus(sent);
    EXPECT_EQ(wire.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_EQ(wire.error_message(), "why");

    const google::rpc::Status details = DetailsOf(wire);
    EXPECT_EQ(details.code(),
              static_cast<int>(absl::StatusCode::kResourceExhausted));
    google::rpc::ErrorInfo info;
    ASSERT_GE(details.details_size(), 1);
    ASSERT_TRUE(details.details(0).UnpackTo(&info));
    EXPECT_EQ(info.reason(), ReasonName(reason));
    EXPECT_EQ(info.domain(), "tally.v1");
    // RetryInfo exactly when a retry of the same request can succeed.
    const bool retryable = RetryDelay(reason).has_value();
    ASSERT_EQ(details.details_size(), retryable ? 2 : 1) << ReasonName(reason);
    if (retryable) {
      google::rpc::RetryInfo retry;
      ASSERT_TRUE(details.details(1).UnpackTo(&retry));
      EXPECT_EQ(absl::Seconds(retry.retry_delay().seconds()) +
                    absl::Nanoseconds(retry.retry_delay().nanos()),
                *RetryDelay(reason));
    }

    const absl::Status received = FromGrpcStatus(wire);
    EXPECT_EQ(received.code(), sent.code());
    EXPECT_EQ(received.message(), "why");
    EXPECT_EQ(ReasonOf(received), reason);
    EXPECT_EQ(IsRetryable(received), retryable);
    EXPECT_EQ(ReasonFromName(ReasonName(reason)), reason);
  }
}

// The code of each reason as docs/reliability.md ("Error reasons") promises
// it to clients.
TEST(ErrorReasonTest, ReasonErrorCarriesTheDocumentedCode) {
  const std::pair<ErrorReason, absl::StatusCode> documented[] = {
      {ErrorReason::kQueueFull, absl::StatusCode::kResourceExhausted},
      {ErrorReason::kMessageTooLarge, absl::StatusCode::kResourceExhausted},
      {ErrorReason::kMemoryLimit, absl::StatusCode::kResourceExhausted},
      {ErrorReason::kSeqGap, absl::StatusCode::kAborted},
      {ErrorReason::kSeqRestored, absl::StatusCode::kAborted},
      {ErrorReason::kWindowPoisoned, absl::StatusCode::kAborted},
      {ErrorReason::kSeqIdReused, absl::StatusCode::kAlreadyExists},
      {ErrorReason::kSeqIdExpired, absl::StatusCode::kAlreadyExists},
      {ErrorReason::kModelExists, absl::StatusCode::kAlreadyExists},
      {ErrorReason::kModelDamaged, absl::StatusCode::kFailedPrecondition},
      {ErrorReason::kShuttingDown, absl::StatusCode::kUnavailable},
      {ErrorReason::kRankFailed, absl::StatusCode::kUnavailable}};
  ASSERT_EQ(std::size(documented), std::size(kAllReasons));
  for (const auto& [reason, code] : documented) {
    const absl::Status status = ReasonError(reason, "why");
    EXPECT_EQ(status.code(), code) << ReasonName(reason);
    EXPECT_EQ(status.message(), "why");
    EXPECT_EQ(ReasonOf(status), reason);
  }
}

TEST(ErrorReasonTest, NamesAreDistinctUpperSnakeCase) {
  std::set<std::string> names;
  for (ErrorReason reason : kAllReasons) {
    const std::string name(ReasonName(reason));
    EXPECT_TRUE(names.insert(name).second) << name;
    for (char c : name) EXPECT_TRUE((c >= 'A' && c <= 'Z') || c == '_') << name;
  }
  EXPECT_EQ(ReasonFromName("NOT_A_REASON"), std::nullopt);
}

TEST(ErrorReasonTest, OnlyAFullQueueOrAStoppingServerIsRetryable) {
  EXPECT_TRUE(IsRetryable(
      WithReason(absl::ResourceExhaustedError(""), ErrorReason::kQueueFull)));
  EXPECT_FALSE(IsRetryable(WithReason(absl::ResourceExhaustedError(""),
                                      ErrorReason::kMessageTooLarge)));
  EXPECT_FALSE(IsRetryable(
      WithReason(absl::ResourceExhaustedError(""), ErrorReason::kMemoryLimit)));
  EXPECT_TRUE(IsRetryable(
      WithReason(absl::UnavailableError(""), ErrorReason::kShuttingDown)));
  // Without a reason: gRPC's own "message larger than max" is
  // RESOURCE_EXHAUSTED and must not be retried; a lost connection is.
  EXPECT_FALSE(IsRetryable(absl::ResourceExhaustedError("")));
  EXPECT_TRUE(IsRetryable(absl::UnavailableError("")));
  EXPECT_TRUE(IsRetryable(absl::DeadlineExceededError("")));
  EXPECT_FALSE(IsRetryable(absl::InvalidArgumentError("")));
}

TEST(ErrorReasonTest, OkStaysOkAndAStatusWithoutReasonSendsNoDetails) {
  EXPECT_TRUE(WithReason(absl::OkStatus(), ErrorReason::kQueueFull).ok());
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  const grpc::Status plain = ToGrpcStatus(absl::NotFoundError("gone"));
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(plain.error_details().empty());
  EXPECT_EQ(ReasonOf(FromGrpcStatus(plain)), std::nullopt);
}

TEST(ErrorReasonTest, UntrustedDetailsFallBackToTheCode) {
  // Garbage bytes, another service's domain and an unknown reason are all
  // ignored: the status keeps its code and message and gets no reason.
  const grpc::Status garbage(grpc::StatusCode::UNAVAILABLE, "x",
                             std::string("\xff\xff\x01", 3));
  EXPECT_EQ(ReasonOf(FromGrpcStatus(garbage)), std::nullopt);
  EXPECT_TRUE(IsRetryable(FromGrpcStatus(garbage)));

  for (const auto& [domain, reason] :
       {std::pair<std::string, std::string>{"other.v1", "QUEUE_FULL"},
        {"tally.v1", "SOMETHING_NEW"}}) {
    google::rpc::Status details;
    google::rpc::ErrorInfo info;
    info.set_domain(domain);
    info.set_reason(reason);
    details.add_details()->PackFrom(info);
    const absl::Status status =
        FromGrpcStatus(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "y",
                                    details.SerializeAsString()));
    EXPECT_EQ(ReasonOf(status), std::nullopt) << domain << " " << reason;
    EXPECT_FALSE(IsRetryable(status));
    EXPECT_EQ(status.message(), "y");
  }
}

}  // namespace
}  // namespace tally
