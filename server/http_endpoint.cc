#include "server/http_endpoint.h"

#include <CivetServer.h>
#include <prometheus/text_serializer.h>

#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace tally {
namespace {

void Respond(mg_connection* connection, int code, const char* status,
             const std::string& content_type, const std::string& body,
             const std::string& extra_headers = "") {
  const std::string head = absl::StrCat(
      "HTTP/1.1 ", code, " ", status, "\r\nContent-Type: ", content_type,
      "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
      "Connection: close\r\n\r\n");
  mg_write(connection, head.data(), head.size());
  mg_write(connection, body.data(), body.size());
}

// Whether the request carries `scraper`'s HTTP Basic credentials.
bool Authorized(mg_connection* connection, const BasicCredentials& scraper) {
  const char* header = mg_get_header(connection, "Authorization");
  if (header == nullptr) return false;
  absl::string_view value = header;
  if (!absl::ConsumePrefix(&value, "Basic ")) return false;
  std::string decoded;
  if (!absl::Base64Unescape(absl::StripAsciiWhitespace(value), &decoded)) {
    return false;
  }
  const size_t colon = decoded.find(':');
  if (colon == std::string::npos) return false;
  return scraper.Matches(absl::string_view(decoded).substr(0, colon),
                         absl::string_view(decoded).substr(colon + 1));
}

// A probe's answer from `checked`: OK, or UNAVAILABLE "<what>: <why>".
absl::Status ProbeAnswer(absl::string_view what, const absl::Status& checked) {
  if (checked.ok()) return checked;
  return absl::UnavailableError(absl::StrCat(what, ": ", checked.message()));
}

}  // namespace

class HttpEndpoint::MetricsHandler : public CivetHandler {
 public:
  MetricsHandler(std::shared_ptr<prometheus::Collectable> metrics,
                 std::optional<BasicCredentials> scraper)
      : metrics_(std::move(metrics)), scraper_(std::move(scraper)) {}

  bool handleGet(CivetServer*, mg_connection* connection) override {
    if (scraper_.has_value() && !Authorized(connection, *scraper_)) {
      Respond(connection, 401, "Unauthorized", "text/plain",
              "credentials required\n",
              "WWW-Authenticate: Basic realm=\"tally metrics\"\r\n");
      return true;
    }
    const std::string body =
        prometheus::TextSerializer().Serialize(metrics_->Collect());
    Respond(connection, 200, "OK", "text/plain; version=0.0.4; charset=utf-8",
            body);
    return true;
  }

 private:
  std::shared_ptr<prometheus::Collectable> metrics_;
  std::optional<BasicCredentials> scraper_;
};

class HttpEndpoint::ProbeHandler : public CivetHandler {
 public:
  explicit ProbeHandler(std::function<absl::Status()> check)
      : check_(std::move(check)) {}

  bool handleGet(CivetServer*, mg_connection* connection) override {
    const absl::Status status = check_();
    if (status.ok()) {
      Respond(connection, 200, "OK", "text/plain", "ok\n");
    } else {
      Respond(connection, 503, "Service Unavailable", "text/plain",
              absl::StrCat(status.message(), "\n"));
    }
    return true;
  }

 private:
  std::function<absl::Status()> check_;
};

absl::StatusOr<std::unique_ptr<HttpEndpoint>> HttpEndpoint::Start(
    const std::string& address,
    std::shared_ptr<prometheus::Collectable> metrics,
    std::optional<BasicCredentials> scraper) {
  std::unique_ptr<HttpEndpoint> endpoint(new HttpEndpoint());
  // Enough threads that a few slow or idle scrapers cannot starve the
  // probes, and a request timeout that frees a thread a stalled client holds.
  const std::vector<std::string> options = {"listening_ports",    address,
                                            "num_threads",        "8",
                                            "request_timeout_ms", "5000"};
  try {
    endpoint->server_ = std::make_unique<CivetServer>(options);
  } catch (const CivetException& e) {
    return absl::UnavailableError(absl::StrCat(
        "metrics endpoint: cannot listen on ", address, ": ", e.what()));
  }
  const std::vector<int> ports = endpoint->server_->getListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(
        absl::StrCat("metrics endpoint: cannot listen on ", address));
  }
  endpoint->port_ = ports.front();
  endpoint->metrics_ =
      std::make_unique<MetricsHandler>(std::move(metrics), std::move(scraper));
  endpoint->healthz_ = std::make_unique<ProbeHandler>(
      [e = endpoint.get()] { return e->Health(); });
  endpoint->readyz_ = std::make_unique<ProbeHandler>(
      [e = endpoint.get()] { return e->Readiness(); });
  endpoint->server_->addHandler("/metrics", endpoint->metrics_.get());
  endpoint->server_->addHandler("/healthz", endpoint->healthz_.get());
  endpoint->server_->addHandler("/readyz", endpoint->readyz_.get());
  return endpoint;
}

HttpEndpoint::~HttpEndpoint() {
  // Stops the threads before the handlers they call go.
  if (server_) server_->close();
}

void HttpEndpoint::SetReady(bool ready, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  readiness_ =
      ready ? absl::OkStatus()
            : absl::UnavailableError(absl::StrCat("not ready: ", reason));
}

void HttpEndpoint::SetReadinessCheck(std::function<absl::Status()> check) {
  absl::MutexLock lock(&mu_);
  check_ = std::move(check);
}

absl::Status HttpEndpoint::Readiness() const {
  std::function<absl::Status()> check;
  {
    absl::MutexLock lock(&mu_);
    if (!readiness_.ok() || !check_) return readiness_;
    check = check_;
  }
  return ProbeAnswer("not ready", check());
}

void HttpEndpoint::SetLivenessCheck(std::function<absl::Status()> check) {
  absl::MutexLock lock(&mu_);
  liveness_check_ = std::move(check);
}

absl::Status HttpEndpoint::Health() const {
  std::function<absl::Status()> check;
  {
    absl::MutexLock lock(&mu_);
    if (!liveness_check_) return absl::OkStatus();
    check = liveness_check_;
  }
  return ProbeAnswer("unhealthy", check());
}

}  // namespace tally
