#include "proto/grpc_status.h"

#include <optional>
#include <string>

#include "base/error_reason.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace tally {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(status.code());
  std::string message(status.message());
  const std::optional<ErrorReason> reason = ReasonOf(status);
  if (!reason.has_value()) return grpc::Status(code, message);
  google::rpc::Status details;
  details.set_code(static_cast<int>(status.code()));
  details.set_message(message);
  google::rpc::ErrorInfo info;
  info.set_reason(std::string(ReasonName(*reason)));
  info.set_domain(kErrorDomain);
  details.add_details()->PackFrom(info);
  if (std::optional<absl::Duration> delay = RetryDelay(*reason)) {
    google::rpc::RetryInfo retry;
    const int64_t nanos = absl::ToInt64Nanoseconds(*delay);
    retry.mutable_retry_delay()->set_seconds(nanos / 1000000000);
    retry.mutable_retry_delay()->set_nanos(
        static_cast<int32_t>(nanos % 1000000000));
    details.add_details()->PackFrom(retry);
  }
  return grpc::Status(code, message, details.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status result(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
  google::rpc::Status details;
  if (status.error_details().empty() ||
      !details.ParseFromString(status.error_details())) {
    return result;
  }
  for (const google::protobuf::Any& detail : details.details()) {
    google::rpc::ErrorInfo info;
    if (!detail.UnpackTo(&info) || info.domain() != kErrorDomain) continue;
    if (std::optional<ErrorReason> reason = ReasonFromName(info.reason())) {
      return WithReason(std::move(result), *reason);
    }
  }
  return result;
}

}  // namespace tally
