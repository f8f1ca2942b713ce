// absl::Status <-> grpc::Status, keeping the ErrorReason (base/error_reason.h).
//
// The server answers every failed call with ToGrpcStatus: the canonical code,
// the message, and in gRPC's rich error details (the binary
// `grpc-status-details-bin` trailer, a google.rpc.Status) a
// google.rpc.ErrorInfo{reason, domain "tally.v1"} and, for a retryable reason,
// a google.rpc.RetryInfo. Clients turn the answer back with FromGrpcStatus
// and ask IsRetryable.
//
//   grpc::Status Handler(...) { return ToGrpcStatus(DoWork()); }
//   absl::Status status = FromGrpcStatus(stub->Call(&context, req, &resp));
//   if (IsRetryable(status)) ...
#ifndef TALLY_PROTO_GRPC_STATUS_H_
#define TALLY_PROTO_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace tally {

// The google.rpc.ErrorInfo domain of tally's reasons.
inline constexpr char kErrorDomain[] = "tally.v1";

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace tally

#endif  // TALLY_PROTO_GRPC_STATUS_H_
