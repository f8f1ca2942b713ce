#include "server/metrics.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace tally {
namespace {

// 1e-4 .. 1e4 in quarter decades: grad norms of healthy and diverging runs.
prometheus::Histogram::BucketBoundaries GradNormBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (int i = -16; i <= 16; ++i) b.push_back(std::pow(10.0, i / 4.0));
  return b;
}

// 1 ms .. ~65 s, doubling.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double s = 0.001; s < 70; s *= 2) b.push_back(s);
  return b;
}

}  // namespace

struct ServerMetrics::ModelSeries {
  prometheus::Gauge* grad_norm;
  prometheus::Histogram* grad_norm_distribution;
  prometheus::Gauge* clip_coefficient;
  prometheus::Counter* steps_applied;
  prometheus::Counter* steps_skipped;
  prometheus::Counter* valid_tokens;
  prometheus::Counter* samples;
  prometheus::Gauge* pending_tokens;
  prometheus::Gauge* loss;
  prometheus::Gauge* step;
  prometheus::Histogram* forward_backward_seconds;
  prometheus::Histogram* optim_step_seconds;
};

ServerMetrics::~ServerMetrics() = default;

absl::StatusOr<std::unique_ptr<ServerMetrics>> ServerMetrics::Create(
    const std::string& address) {
  std::unique_ptr<ServerMetrics> m(new ServerMetrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *m->registry_;
  m->grad_norm_ = &prometheus::BuildGauge()
                       .Name("tally_grad_norm")
                       .Help("Pre-clip global gradient norm of the last step")
                       .Register(r);
  m->grad_norm_distribution_ =
      &prometheus::BuildHistogram()
           .Name("tally_grad_norm_distribution")
           .Help("Pre-clip global gradient norms (finite ones)")
           .Register(r);
  m->clip_coefficient_ = &prometheus::BuildGauge()
                              .Name("tally_clip_coefficient")
                              .Help(
                                  "Clip coefficient of the last step (1: "
                                  "not clipped)")
                              .Register(r);
  m->optim_steps_ = &prometheus::BuildCounter()
                         .Name("tally_optim_steps_total")
                         .Help("OptimStep outcomes")
                         .Register(r);
  m->valid_tokens_ = &prometheus::BuildCounter()
                          .Name("tally_valid_tokens_total")
                          .Help("Valid tokens backpropagated")
                          .Register(r);
  m->samples_ = &prometheus::BuildCounter()
                     .Name("tally_samples_total")
                     .Help(
                         "Samples with at least one valid token "
                         "backpropagated")
                     .Register(r);
  m->pending_tokens_ = &prometheus::BuildGauge()
                            .Name("tally_pending_tokens")
                            .Help("Valid tokens in the pending window")
                            .Register(r);
  m->loss_ = &prometheus::BuildGauge()
                  .Name("tally_loss")
                  .Help("Mean loss of the last ForwardBackward")
                  .Register(r);
  m->model_step_ = &prometheus::BuildGauge()
                        .Name("tally_model_step")
                        .Help("Optimizer steps applied to the model")
                        .Register(r);
  m->forward_backward_seconds_ = &prometheus::BuildHistogram()
                                      .Name("tally_forward_backward_seconds")
                                      .Help("ForwardBackward execution time")
                                      .Register(r);
  m->optim_step_seconds_ = &prometheus::BuildHistogram()
                                .Name("tally_optim_step_seconds")
                                .Help("OptimStep execution time")
                                .Register(r);
  m->requests_ = &prometheus::BuildCounter()
                      .Name("tally_requests_total")
                      .Help("RPCs by method and status code")
                      .Register(r);
  m->models_ = &prometheus::BuildGauge()
                    .Name("tally_models")
                    .Help("Models loaded")
                    .Register(r)
                    .Add({});
  m->checkpoint_seconds_ =
      &prometheus::BuildHistogram()
           .Name("tally_checkpoint_seconds")
           .Help("Checkpoint save / load time by kind (failures included)")
           .Register(r);
  m->checkpoint_last_success_ =
      &prometheus::BuildGauge()
           .Name("tally_checkpoint_last_success_timestamp_seconds")
           .Help("Unix time of the last checkpoint written successfully")
           .Register(r)
           .Add({});
  m->auth_failures_ = &prometheus::BuildCounter()
                           .Name("tally_auth_failures_total")
                           .Help(
                               "Requests refused for missing or unknown "
                               "bearer tokens")
                           .Register(r);
  prometheus::BuildGauge()
      .Name("tally_build_info")
      .Help("Build information (value 1)")
      .Register(r)
      .Add({{"version", TALLY_VERSION}})
      .Set(1);
  TALLY_RETURN_IF_ERROR(CatchTorch("metrics exposer", [&] {
    m->exposer_ = std::make_unique<prometheus::Exposer>(address);
  }));
  m->exposer_->RegisterCollectable(m->registry_);
  std::vector<int> ports = m->exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(
        absl::StrCat("metrics exposer did not bind ", address));
  }
  m->port_ = ports.front();
  return m;
}

ServerMetrics::ModelSeries& ServerMetrics::Series(const std::string& id) {
  auto& slot = series_[id];
  if (!slot) {
    const prometheus::Labels l = {{"model_id", id}};
    auto with = [&](const char* key, const char* value) {
      prometheus::Labels labels = l;
      labels[key] = value;
      return labels;
    };
    slot = std::make_unique<ModelSeries>(ModelSeries{
        &grad_norm_->Add(l),
        &grad_norm_distribution_->Add(l, GradNormBuckets()),
        &clip_coefficient_->Add(l),
        &optim_steps_->Add(with("outcome", "applied")),
        &optim_steps_->Add(with("outcome", "skipped_nonfinite")),
        &valid_tokens_->Add(l), &samples_->Add(l), &pending_tokens_->Add(l),
        &loss_->Add(l), &model_step_->Add(l),
        &forward_backward_seconds_->Add(l, LatencyBuckets()),
        &optim_step_seconds_->Add(l, LatencyBuckets())});
  }
  return *slot;
}

void ServerMetrics::RecordRequest(const std::string& method,
                                  const std::string& code) {
  requests_->Add({{"method", method}, {"code", code}}).Increment();
}

void ServerMetrics::RecordForwardBackward(
    const std::string& model_id, const v1::ForwardBackwardResponse& result,
    bool accumulated, double seconds) {
  absl::MutexLock lock(&mu_);
  ModelSeries& s = Series(model_id);
  s.forward_backward_seconds->Observe(seconds);
  s.loss->Set(result.loss_mean());
  if (!accumulated) return;
  s.valid_tokens->Increment(static_cast<double>(result.valid_tokens()));
  s.samples->Increment(static_cast<double>(result.num_samples()));
  s.pending_tokens->Set(static_cast<double>(result.accumulated_tokens()));
}

void ServerMetrics::RecordOptimStep(const std::string& model_id,
                                    const v1::OptimStepResponse& result,
                                    double seconds) {
  absl::MutexLock lock(&mu_);
  ModelSeries& s = Series(model_id);
  s.optim_step_seconds->Observe(seconds);
  s.grad_norm->Set(result.grad_norm());
  if (std::isfinite(result.grad_norm())) {
    s.grad_norm_distribution->Observe(result.grad_norm());
  }
  s.clip_coefficient->Set(result.clip_coef());
  (result.skipped() ? s.steps_skipped : s.steps_applied)->Increment();
  s.step->Set(static_cast<double>(result.step()));
  s.pending_tokens->Set(0);
}

void ServerMetrics::SetPendingTokens(const std::string& model_id,
                                     int64_t tokens) {
  absl::MutexLock lock(&mu_);
  Series(model_id).pending_tokens->Set(static_cast<double>(tokens));
}

void ServerMetrics::RecordCheckpoint(const std::string& kind, bool ok,
                                     double seconds) {
  checkpoint_seconds_->Add({{"kind", kind}}, LatencyBuckets()).Observe(seconds);
  if (ok && (kind == "save" || kind == "periodic")) {
    checkpoint_last_success_->SetToCurrentTime();
  }
}

void ServerMetrics::RecordAuthFailure(const std::string& reason) {
  auth_failures_->Add({{"reason", reason}}).Increment();
}

void ServerMetrics::SetModelCount(size_t count) {
  models_->Set(static_cast<double>(count));
}

void ServerMetrics::RemoveModel(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  auto it = series_.find(model_id);
  if (it == series_.end()) return;
  const ModelSeries& s = *it->second;
  grad_norm_->Remove(s.grad_norm);
  grad_norm_distribution_->Remove(s.grad_norm_distribution);
  clip_coefficient_->Remove(s.clip_coefficient);
  optim_steps_->Remove(s.steps_applied);
  optim_steps_->Remove(s.steps_skipped);
  valid_tokens_->Remove(s.valid_tokens);
  samples_->Remove(s.samples);
  pending_tokens_->Remove(s.pending_tokens);
  loss_->Remove(s.loss);
  model_step_->Remove(s.step);
  forward_backward_seconds_->Remove(s.forward_backward_seconds);
  optim_step_seconds_->Remove(s.optim_step_seconds);
  series_.erase(it);
}

}  // namespace tally
