// HttpEndpoint's /readyz: the state the server sets, then the readiness
// check (a command that stopped progressing); /healthz: the liveness check
// (a wedged loop, server/health.h).
#include "server/http_endpoint.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "server/health.h"

namespace tally {
namespace {

TEST(HttpEndpointTest, TheReadinessCheckDecidesWhileTheServerIsReady) {
  auto endpoint = HttpEndpoint::Start(
      "127.0.0.1:0", std::make_shared<prometheus::Registry>(), std::nullopt);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  HttpEndpoint& http = **endpoint;
  absl::Status progress = absl::OkStatus();
  http.SetReadinessCheck([&] { return progress; });
  // Not ready while starting, whatever the check says.
  EXPECT_EQ(http.Readiness().code(), absl::StatusCode::kUnavailable);

  http.SetReady(true, "");
  EXPECT_TRUE(http.Readiness().ok());
  progress = absl::UnavailableError("no progress: hung");
  EXPECT_EQ(http.Readiness(),
            absl::UnavailableError("not ready: no progress: hung"));
  progress = absl::OkStatus();
  EXPECT_TRUE(http.Readiness().ok());

  http.SetReady(false, "draining");  // the server's own state comes first
  EXPECT_EQ(http.Readiness(), absl::UnavailableError("not ready: draining"));
}

TEST(HttpEndpointTest, HealthIsTheLivenessCheck) {
  auto endpoint = HttpEndpoint::Start(
      "127.0.0.1:0", std::make_shared<prometheus::Registry>(), std::nullopt);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  HttpEndpoint& http = **endpoint;
  EXPECT_TRUE(http.Health().ok());  // no check: serving HTTP is enough
  Liveness liveness;
  http.SetLivenessCheck([&] { return liveness.Check(); });
  EXPECT_TRUE(http.Health().ok());
  // Readiness does not matter: a draining rank is still alive.
  http.SetReady(false, "draining");
  absl::Status loop = absl::UnavailableError("wedged: executor");
  http.SetLivenessCheck([&] { return loop; });
  EXPECT_EQ(http.Health(),
            absl::UnavailableError("unhealthy: wedged: executor"));
  loop = absl::OkStatus();
  EXPECT_TRUE(http.Health().ok());
}

}  // namespace
}  // namespace tally
