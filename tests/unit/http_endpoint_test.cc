// HttpEndpoint's /readyz: the state the server sets, then the readiness
// check (a command that stopped progressing).
#include "server/http_endpoint.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>

#include "absl/status/status.h"

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

}  // namespace
}  // namespace tally
