#include "server/token_auth_processor.h"

#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

grpc::Status TokenAuthProcessor::Process(const InputMetadata& auth_metadata,
                                         grpc::AuthContext* context,
                                         OutputMetadata* consumed_auth_metadata,
                                         OutputMetadata* response_metadata) {
  std::optional<absl::string_view> authorization;
  if (auto it = auth_metadata.find("authorization");
      it != auth_metadata.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  const absl::StatusOr<std::string> tenant =
      authenticator_->Authenticate(authorization);
  if (tenant.ok()) return grpc::Status::OK;
  on_failure_(authorization.has_value() ? "invalid_token" : "missing_token");
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      std::string(tenant.status().message()));
}

}  // namespace tally
