// ServerMetrics: the Prometheus metrics of a tally server, exposed over HTTP
// on their own port (`--metrics-port`). Every metric is documented in
// docs/metrics.md; labels are bounded (model ids, RPC names, status codes),
// never request ids.
//
//   TALLY_ASSIGN_OR_RETURN(auto metrics,
//                          tally::ServerMetrics::Create("0.0.0.0:9090"));
//   metrics->RecordOptimStep("demo", result, seconds);
//   int port = metrics->port();
#ifndef TALLY_SERVER_METRICS_H_
#define TALLY_SERVER_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

class ServerMetrics {
 public:
  // Binds `address` ("host:port", port 0 picks a free one).
  static absl::StatusOr<std::unique_ptr<ServerMetrics>> Create(
      const std::string& address);

  ~ServerMetrics();

  int port() const { return port_; }

  void RecordRequest(const std::string& method, const std::string& code);
  // `accumulated`: false for forward_only calls, which add no tokens.
  void RecordForwardBackward(const std::string& model_id,
                             const v1::ForwardBackwardResponse& result,
                             bool accumulated, double seconds);
  void RecordOptimStep(const std::string& model_id,
                       const v1::OptimStepResponse& result, double seconds);
  // Pending tokens of a model's window (after abort, load, step, ...).
  void SetPendingTokens(const std::string& model_id, int64_t tokens);
  void SetModelCount(size_t count);
  // Drops a deleted model's per-model series.
  void RemoveModel(const std::string& model_id);
  // A checkpoint operation of `kind` ("save": client SaveCheckpoint,
  // "periodic", "load", "resume") that took `seconds`; a successful write
  // (save, periodic) also sets the last-success timestamp.
  void RecordCheckpoint(const std::string& kind, bool ok, double seconds);
  // A request refused for its credentials; `reason` is "missing_token" or
  // "invalid_token".
  void RecordAuthFailure(const std::string& reason);

 private:
  ServerMetrics() = default;

  struct ModelSeries;
  ModelSeries& Series(const std::string& model_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;

  prometheus::Family<prometheus::Gauge>* grad_norm_ = nullptr;
  prometheus::Family<prometheus::Histogram>* grad_norm_distribution_ = nullptr;
  prometheus::Family<prometheus::Gauge>* clip_coefficient_ = nullptr;
  prometheus::Family<prometheus::Counter>* optim_steps_ = nullptr;
  prometheus::Family<prometheus::Counter>* valid_tokens_ = nullptr;
  prometheus::Family<prometheus::Counter>* samples_ = nullptr;
  prometheus::Family<prometheus::Gauge>* pending_tokens_ = nullptr;
  prometheus::Family<prometheus::Gauge>* loss_ = nullptr;
  prometheus::Family<prometheus::Gauge>* model_step_ = nullptr;
  prometheus::Family<prometheus::Histogram>* forward_backward_seconds_ =
      nullptr;
  prometheus::Family<prometheus::Histogram>* optim_step_seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Gauge* models_ = nullptr;
  prometheus::Family<prometheus::Histogram>* checkpoint_seconds_ = nullptr;
  prometheus::Gauge* checkpoint_last_success_ = nullptr;
  prometheus::Family<prometheus::Counter>* auth_failures_ = nullptr;

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<ModelSeries>> series_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace tally

#endif  // TALLY_SERVER_METRICS_H_
