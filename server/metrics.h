// ServerMetrics: the Prometheus metrics of one tally rank, exposed over HTTP
// on their own port with the rank's probes (/healthz, /readyz: see
// http_endpoint.h). Every rank serves its own /metrics (so a PodMonitor or a
// scrape config listing every rank sees each one); every series carries a
// constant `rank` label. Rank 0 adds the request-level metrics of the gRPC
// front end (tokens, losses, grad norms, RPC codes, queue depth); every rank
// reports what it executed itself (ForwardBackward / OptimStep time), its
// collectives (calls and bytes per communicator and op) and the bytes of its
// parameter, gradient and optimizer-state shards. Every metric is documented
// in docs/metrics.md; labels are bounded (model ids, RPC names, status
// codes, communicator roles), never request ids. Every series a dashboard
// panel or alert plots exists before its first event (at 0, or NaN for a
// statistic not computed yet), and /metrics also carries the process_*
// series (server/process_metrics.h).
//
//   TALLY_ASSIGN_OR_RETURN(
//       auto metrics,
//       tally::ServerMetrics::Create("0.0.0.0:9090", engine.get()));
//   metrics->RecordOptimStep("demo", result, seconds);  // rank 0
//   metrics->ObserveOptimStepSeconds("demo", seconds);  // ranks > 0
//   metrics->RecordRankState();  // ranks > 0, after each command
//   int port = metrics->port();
#ifndef TALLY_SERVER_METRICS_H_
#define TALLY_SERVER_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "runtime/engine/engine.h"
#include "runtime/sample/decode_control.h"
#include "server/auth.h"
#include "server/device_metrics.h"
#include "server/http_endpoint.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

class ServerMetrics {
 public:
  // The tally_policy_* families (importance ratio, clipped tokens ratio,
  // log-probability gap, KL), one per unit.
  using PolicyFamilies = std::array<prometheus::Family<prometheus::Gauge>*, 4>;

  // Binds `address` ("host:port", port 0 picks a free one). `engine` (not
  // owned, outlives the metrics, only read) gives the `rank` label and the rank
  // state. The request-flow recorders (RecordRequest, RecordDuplicate,
  // RecordPoisonedWindow, RecordSeqGapWait, SetQueueDepth, ObserveQueueWait,
  // RecordRankFailure, RecordAuthFailure, SetReady, the memory admission
  // ones) may run on any thread;
  // every other method runs on the engine's command thread (the engine is not
  // thread-safe) and refreshes the rank state after recording. With `scraper`,
  // /metrics answers 401 to requests without its HTTP Basic credentials (the
  // series name every tenant's models).
  static absl::StatusOr<std::unique_ptr<ServerMetrics>> Create(
      const std::string& address, Engine* engine,
      std::optional<BasicCredentials> scraper = std::nullopt);

  ~ServerMetrics();

  int port() const { return http_->port(); }
  // What the port's /readyz answers (not ready until the first call).
  void SetReady(bool ready, const std::string& reason) {
    http_->SetReady(ready, reason);
  }
  // HttpEndpoint::SetReadinessCheck.
  void SetReadinessCheck(std::function<absl::Status()> check) {
    http_->SetReadinessCheck(std::move(check));
  }
  // HttpEndpoint::SetLivenessCheck.
  void SetLivenessCheck(std::function<absl::Status()> check) {
    http_->SetLivenessCheck(std::move(check));
  }

  // Front end (rank 0).
  void RecordRequest(const std::string& method, const std::string& code);
  // `accumulated`: false for forward_only calls (phase "eval"), which add
  // nothing to the window. `reduction`: the request's, which says what the
  // call adds to the window's loss (tally_window_loss).
  void RecordForwardBackward(const std::string& model_id,
                             const v1::ForwardBackwardResponse& result,
                             bool accumulated, v1::LossReduction reduction,
                             double seconds);
  // Applied or skipped: either ends the window.
  void RecordOptimStep(const std::string& model_id,
                       const v1::OptimStepResponse& result, double seconds);
  // Pending tokens of a model's window (after abort, load, step, ...). 0 (an
  // emptied window: created, aborted, loaded) also drops the loss the window
  // had accumulated for tally_window_loss.
  void SetPendingTokens(const std::string& model_id, int64_t tokens);
  void SetModelCount(size_t count);
  // Drops a deleted model's per-model series.
  void RemoveModel(const std::string& model_id);
  // A checkpoint operation of `kind` ("save": client SaveCheckpoint,
  // "periodic", "exit", "load", "resume", "export": ExportWeights) that took
  // `seconds`; a successful checkpoint write (save, periodic, exit) also sets
  // the last-success timestamp (an export is no checkpoint).
  void RecordCheckpoint(const std::string& kind, bool ok, double seconds);
  // A request refused for its credentials; `reason` is "missing_token" or
  // "invalid_token".
  void RecordAuthFailure(const std::string& reason);

  // Every rank: execution time of a command on this rank (rank 0's
  // RecordForwardBackward / RecordOptimStep observe the same histograms).
  void ObserveForwardBackwardSeconds(const std::string& model_id,
                                     double seconds);
  void ObserveOptimStepSeconds(const std::string& model_id, double seconds);
  // Rank 0: a Sample of `model_id` that generated `tokens` tokens in
  // `seconds`. Ranks > 0: its seconds alone.
  void RecordSample(const std::string& model_id, int64_t tokens,
                    double seconds);
  void ObserveSampleSeconds(const std::string& model_id, double seconds);
  // Rank 0: a decode of `model_id` reported `stats` (decode_control.h): the
  // time to first token, each later step's time, and the running decode's
  // KV-cache bytes and active sequences (0 once it ends).
  void ObserveDecodeProgress(const std::string& model_id,
                             const DecodeStats& stats);
  // Copies this rank's collective counters and shard sizes from the engine;
  // models gone from the engine lose their series, and on rank 0 every
  // model the engine holds has its request-level series.
  void RecordRankState();
  // From now on RecordRankState also reads the memory of `device`, the
  // rank's, into the device memory gauges (server/device_metrics.h); nothing
  // for a CPU device.
  void WatchDeviceMemory(const torch::Device& device);

  // A retried sequenced request answered without executing it again.
  void RecordDuplicate(const std::string& model_id);
  void RecordPoisonedWindow(const std::string& model_id);
  // How long a missing seq_id held back the requests behind it.
  void RecordSeqGapWait(double seconds);
  // Requests held (waiting, queued or executing).
  void SetQueueDepth(size_t depth);
  // Memory admission (server/admission.h): the limits (0: none), the
  // estimated resident bytes admitted, and a refused "model" or "call".
  void SetMemoryLimits(double limit_bytes, double per_tenant_bytes);
  void SetMemoryAdmitted(double bytes);
  void RecordMemoryRefusal(const std::string& refused);
  // How long an accepted `method` request waited (behind the queue, a
  // seq_id gap or its model's earlier requests) before it began to execute.
  void ObserveQueueWait(const std::string& method, double seconds);
  void RecordRankFailure();

 private:
  ServerMetrics() = default;

  // Rank 0: the series of the refusal counters, the admitted bytes and every
  // RPC's OK count, at 0 before anything happens.
  void StartRequestSeriesAtZero();

  struct ModelSeries;
  struct RankModelSeries;
  struct CommSeries;
  ModelSeries& Series(const std::string& model_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  RankModelSeries& RankSeries(const std::string& model_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveRankSeries(const std::string& model_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The model's tally_sample_seconds series, created at its first Sample.
  prometheus::Histogram& SampleSeconds(const std::string& model_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveModelSeries(const std::string& model_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The labels of model `id`'s execution-time histograms: model_id on rank
  // 0; none on the other ranks, whose histograms every model shares (they
  // would otherwise multiply each model's 50 series by the world size).
  prometheus::Labels TimingLabels(const std::string& id) const;
  void RecordRankStateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Creates model_id's tally_policy_* series (at NaN).
  std::vector<prometheus::Gauge*> PolicySeries(const std::string& model_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the tally_policy_* series of `s`.
  void RecordPolicy(const v1::PolicyStats& policy, ModelSeries& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Engine* engine_ = nullptr;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<HttpEndpoint> http_;

  prometheus::Family<prometheus::Gauge>* grad_norm_ = nullptr;
  prometheus::Family<prometheus::Histogram>* grad_norm_distribution_ = nullptr;
  prometheus::Family<prometheus::Gauge>* clip_coefficient_ = nullptr;
  prometheus::Family<prometheus::Counter>* optim_steps_ = nullptr;
  prometheus::Family<prometheus::Counter>* valid_tokens_ = nullptr;
  prometheus::Family<prometheus::Counter>* samples_ = nullptr;
  prometheus::Family<prometheus::Gauge>* pending_tokens_ = nullptr;
  prometheus::Family<prometheus::Gauge>* loss_ = nullptr;
  prometheus::Family<prometheus::Counter>* loss_sum_ = nullptr;
  prometheus::Family<prometheus::Gauge>* window_loss_ = nullptr;
  PolicyFamilies policy_{};
  prometheus::Family<prometheus::Gauge>* model_step_ = nullptr;
  prometheus::Family<prometheus::Histogram>* forward_backward_seconds_ =
      nullptr;
  prometheus::Family<prometheus::Histogram>* optim_step_seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Counter>* sampled_tokens_ = nullptr;
  prometheus::Family<prometheus::Histogram>* sample_seconds_ = nullptr;
  prometheus::Family<prometheus::Histogram>* sample_first_token_seconds_ =
      nullptr;
  prometheus::Family<prometheus::Histogram>* sample_token_seconds_ = nullptr;
  prometheus::Family<prometheus::Gauge>* sample_kv_cache_bytes_ = nullptr;
  prometheus::Family<prometheus::Gauge>* sample_active_sequences_ = nullptr;
  prometheus::Family<prometheus::Counter>* duplicate_requests_ = nullptr;
  prometheus::Family<prometheus::Counter>* poisoned_windows_ = nullptr;
  prometheus::Family<prometheus::Counter>* collective_calls_ = nullptr;
  prometheus::Family<prometheus::Counter>* collective_bytes_ = nullptr;
  prometheus::Family<prometheus::Gauge>* parameter_bytes_ = nullptr;
  prometheus::Family<prometheus::Gauge>* gradient_bytes_ = nullptr;
  prometheus::Family<prometheus::Gauge>* optimizer_state_bytes_ = nullptr;
  prometheus::Gauge* models_ = nullptr;
  prometheus::Histogram* seq_gap_wait_seconds_ = nullptr;
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Family<prometheus::Histogram>* queue_wait_seconds_ = nullptr;
  prometheus::Family<prometheus::Gauge>* memory_limit_bytes_ = nullptr;
  prometheus::Family<prometheus::Gauge>* memory_admitted_bytes_ = nullptr;
  prometheus::Family<prometheus::Counter>* memory_refusals_ = nullptr;
  prometheus::Counter* rank_failures_ = nullptr;
  prometheus::Family<prometheus::Histogram>* checkpoint_seconds_ = nullptr;
  prometheus::Gauge* checkpoint_last_success_ = nullptr;
  prometheus::Family<prometheus::Counter>* auth_failures_ = nullptr;

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<ModelSeries>> series_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<RankModelSeries>> rank_series_
      ABSL_GUARDED_BY(mu_);
  // Keyed by "<communicator roles>/<op>".
  std::map<std::string, std::unique_ptr<CommSeries>> comm_series_
      ABSL_GUARDED_BY(mu_);
  std::unique_ptr<DeviceMemoryGauges> device_memory_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tally

#endif  // TALLY_SERVER_METRICS_H_
