#include "server/token_auth_processor.h"

#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace tally {
namespace {

// Services every client may call without a token: probes and tooling.
constexpr absl::string_view kOpenServices[] = {
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
};

// The value of `key` in `metadata`, if present.
std::optional<absl::string_view> Find(
    const grpc::AuthMetadataProcessor::InputMetadata& metadata,
    absl::string_view key) {
  const auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return std::nullopt;
  return absl::string_view(it->second.data(), it->second.size());
}

}  // namespace

grpc::Status TokenAuthProcessor::Process(const InputMetadata& auth_metadata,
                                         grpc::AuthContext* context,
                                         OutputMetadata* consumed_auth_metadata,
                                         OutputMetadata* response_metadata) {
  // gRPC routes the call by its :path, so this is the method that would run.
  if (const std::optional<absl::string_view> path =
          Find(auth_metadata, ":path")) {
    for (absl::string_view open : kOpenServices) {
      if (absl::StartsWith(*path, open)) return grpc::Status::OK;
    }
  }
  const std::optional<absl::string_view> authorization =
      Find(auth_metadata, "authorization");
  const absl::StatusOr<std::string> tenant =
      authenticator_->Authenticate(authorization);
  if (tenant.ok()) return grpc::Status::OK;
  on_failure_(authorization.has_value() ? "invalid_token" : "missing_token");
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      std::string(tenant.status().message()));
}

}  // namespace tally
