// HttpEndpoint: a rank's HTTP port — Prometheus' /metrics and the
// Kubernetes probes.
//
//   GET /metrics  the collectable (a registry) in Prometheus' text format;
//                 behind HTTP Basic
//                 credentials when given (401 otherwise)
//   GET /healthz  200 while the rank can make progress: the process serves
//                 HTTP and what the liveness check says (its loops beat:
//                 server/health.h), else 503 with the reason
//   GET /readyz   200 while the rank is ready for work, else 503 with the
//                 reason (draining, a failed rank, not started, or what the
//                 readiness check says: a command that stopped progressing)
//
// The probes need no credentials and work whatever the gRPC port's
// transport, so TLS servers get honest readiness from plain httpGet probes.
//
//   TALLY_ASSIGN_OR_RETURN(auto http, tally::HttpEndpoint::Start(
//       "0.0.0.0:9090", registry, std::nullopt));
//   http->SetReady(true, "");
//   ...
//   http->SetReady(false, "draining");
#ifndef TALLY_SERVER_HTTP_ENDPOINT_H_
#define TALLY_SERVER_HTTP_ENDPOINT_H_

#include <prometheus/collectable.h>
#include <prometheus/registry.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/auth.h"

class CivetServer;

namespace tally {

class HttpEndpoint {
 public:
  // Listens on `address` ("host:port"; port 0 picks a free one). Not ready
  // until SetReady(true, ...).
  static absl::StatusOr<std::unique_ptr<HttpEndpoint>> Start(
      const std::string& address,
      std::shared_ptr<prometheus::Collectable> metrics,
      std::optional<BasicCredentials> scraper);
  ~HttpEndpoint();

  int port() const { return port_; }
  // What /readyz answers; `reason` says why when not ready.
  void SetReady(bool ready, const std::string& reason);
  // Consulted by every /readyz while SetReady says ready: an error makes
  // the rank not ready, with the error's message as the reason. Called on
  // the probe's thread, so it must not block.
  void SetReadinessCheck(std::function<absl::Status()> check);
  // /readyz's answer: OK, or UNAVAILABLE with the reason.
  absl::Status Readiness() const;
  // Consulted by every /healthz (none: always healthy): an error makes the
  // rank unhealthy, with the error's message as the reason. Called on the
  // probe's thread, so it must not block.
  void SetLivenessCheck(std::function<absl::Status()> check);
  // /healthz's answer: OK, or UNAVAILABLE with the reason.
  absl::Status Health() const;

 private:
  class MetricsHandler;
  class ProbeHandler;

  HttpEndpoint() = default;

  std::unique_ptr<CivetServer> server_;
  std::unique_ptr<MetricsHandler> metrics_;
  std::unique_ptr<ProbeHandler> healthz_;
  std::unique_ptr<ProbeHandler> readyz_;
  int port_ = 0;
  mutable absl::Mutex mu_;
  absl::Status readiness_ ABSL_GUARDED_BY(mu_) =
      absl::UnavailableError("starting");
  std::function<absl::Status()> check_ ABSL_GUARDED_BY(mu_);
  std::function<absl::Status()> liveness_check_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tally

#endif  // TALLY_SERVER_HTTP_ENDPOINT_H_
