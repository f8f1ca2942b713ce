#include "server/metrics.h"

#include <google/protobuf/descriptor.h>
#include <prometheus/metric_family.h>

#include <cmath>
#include <iterator>
#include <limits>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "runtime/parallel/compute_backend.h"
#include "runtime/parallel/zero.h"
#include "server/process_metrics.h"

namespace tally {
namespace {

// 1e-4 .. 1e4 in quarter decades: grad norms of healthy and diverging runs.
prometheus::Histogram::BucketBoundaries GradNormBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (int i = -16; i <= 16; ++i) b.push_back(std::pow(10.0, i / 4.0));
  return b;
}

// `count` bounds doubling from 1 ms: 0.001 * 2^k s for k = 0 .. count - 1.
prometheus::Histogram::BucketBoundaries DoublingFromOneMs(int count) {
  prometheus::Histogram::BucketBoundaries b;
  double bound = 0.001;
  for (int k = 0; k < count; ++k, bound *= 2) b.push_back(bound);
  return b;
}

// 1 ms .. 4194.304 s, ~70 min (23 buckets): seq_id gap waits, up to the
// longest --seq-gap-timeout-secs (3600).
prometheus::Histogram::BucketBoundaries SeqGapBuckets() {
  return DoublingFromOneMs(23);
}

// 1 ms .. 2097.152 s, ~35 min (22 buckets): ForwardBackward and OptimStep,
// which a large call or a slow collective can hold for many minutes.
prometheus::Histogram::BucketBoundaries CommandBuckets() {
  return DoublingFromOneMs(22);
}

// 0.1 ms .. 3.2768 s (16 buckets): one decoding step, from a small model
// on a GPU to a large one on CPUs.
prometheus::Histogram::BucketBoundaries TokenBuckets() {
  prometheus::Histogram::BucketBoundaries b = DoublingFromOneMs(16);
  for (double& bound : b) bound /= 10;
  return b;
}

// 1 ms .. 16777.216 s, ~4.7 h (25 buckets): checkpoint saves and loads of
// large models on slow storage.
prometheus::Histogram::BucketBoundaries CheckpointBuckets() {
  return DoublingFromOneMs(25);
}

// The tally_policy_* families, one per unit (see PolicyStat).
enum PolicyFamily : size_t {
  kImportanceRatio,  // trainer / sampler token probability
  kClippedRatio,     // clipped tokens / valid tokens
  kLogprobGapNats,   // |trainer - sampler| log-probability
  kKlNats,           // KL(sampler || trainer) estimates
  kNumPolicyFamilies
};
static_assert(kNumPolicyFamilies ==
              std::tuple_size_v<ServerMetrics::PolicyFamilies>);

// A series of the tally_policy_* families: its family, its one label (none
// when `label` is null), and the v1::PolicyStats field it shows.
struct PolicyStat {
  PolicyFamily family;
  const char* label;
  const char* value_label;
  double (v1::PolicyStats::*value)() const;
};
constexpr PolicyStat kPolicyStats[] = {
    {kImportanceRatio, "stat", "mean", &v1::PolicyStats::ratio_mean},
    {kImportanceRatio, "stat", "min", &v1::PolicyStats::ratio_min},
    {kImportanceRatio, "stat", "max", &v1::PolicyStats::ratio_max},
    {kClippedRatio, nullptr, nullptr, &v1::PolicyStats::clipped_fraction},
    {kLogprobGapNats, "stat", "mean", &v1::PolicyStats::logprob_gap_mean},
    {kLogprobGapNats, "stat", "max", &v1::PolicyStats::logprob_gap_max},
    {kKlNats, "estimator", "k1", &v1::PolicyStats::kl_k1},
    {kKlNats, "estimator", "k3", &v1::PolicyStats::kl_k3},
};

// The `phase` of a ForwardBackward: "train" (accumulating) or "eval"
// (forward_only).
prometheus::Labels PhaseLabels(const std::string& model_id, const char* phase) {
  return {{"model_id", model_id}, {"phase", phase}};
}

// What a call adds to its window's loss, which the step's normalizer divides
// (tally_window_loss): the loss sum under TOKEN_MEAN and SUM (normalizer:
// the window's tokens, or 1), the sum of the counted samples' token means
// under SAMPLE_MEAN (normalizer: the window's samples), as the runtime
// computes loss_mean.
double WindowLossTerm(const v1::ForwardBackwardResponse& result,
                      v1::LossReduction reduction) {
  if (reduction != v1::LOSS_REDUCTION_SAMPLE_MEAN) return result.loss_sum();
  double sum = 0.0;
  for (const v1::SampleResult& sample : result.samples()) {
    if (sample.valid_tokens() > 0) {
      sum += sample.loss_sum() / static_cast<double>(sample.valid_tokens());
    }
  }
  return sum;
}

// The engine's communicators, each once, named by the roles it plays
// ("world", "data+dp_shard", "control"): a single-rank engine uses one
// communicator for every role, and its counters must not be summed twice.
std::vector<std::pair<std::string, const Communicator*>> NamedCommunicators(
    Engine& engine) {
  const EngineGroups& g = engine.groups();
  const std::vector<std::pair<const char*, const Communicator*>> roles = {
      {"world", g.world},
      {"data", g.data},
      {"data_and_cp", g.data_and_cp},
      {"replicas", g.replicas},
      {"dp_replicate", g.dp_replicate},
      {"dp_shard", g.dp_shard},
      {"cp", g.cp},
      {"tp", g.tp},
      {"ep", g.ep},
      {"expert_replicas", g.expert_replicas},
      {"pp", g.pp},
      {"control", &engine.control()}};
  std::vector<std::pair<std::vector<std::string>, const Communicator*>> merged;
  for (const auto& [role, comm] : roles) {
    if (comm == nullptr) continue;
    auto it = std::find_if(merged.begin(), merged.end(),
                           [&](const auto& m) { return m.second == comm; });
    if (it == merged.end()) {
      merged.push_back({{role}, comm});
    } else {
      it->first.push_back(role);
    }
  }
  std::vector<std::pair<std::string, const Communicator*>> named;
  for (const auto& [names, comm] : merged) {
    named.emplace_back(absl::StrJoin(names, "+"), comm);
  }
  return named;
}

int64_t TensorBytes(const torch::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
}

// Registers metric families that carry this rank's constant `rank` label.
class FamilyBuilder {
 public:
  FamilyBuilder(prometheus::Registry& registry, int rank)
      : registry_(registry), rank_({{"rank", absl::StrCat(rank)}}) {}

  prometheus::Family<prometheus::Gauge>* Gauge(const char* name,
                                               const char* help) {
    return &prometheus::BuildGauge()
                .Name(name)
                .Help(help)
                .Labels(rank_)
                .Register(registry_);
  }
  prometheus::Family<prometheus::Counter>* Counter(const char* name,
                                                   const char* help) {
    return &prometheus::BuildCounter()
                .Name(name)
                .Help(help)
                .Labels(rank_)
                .Register(registry_);
  }
  prometheus::Family<prometheus::Histogram>* Histogram(const char* name,
                                                       const char* help) {
    return &prometheus::BuildHistogram()
                .Name(name)
                .Help(help)
                .Labels(rank_)
                .Register(registry_);
  }

 private:
  prometheus::Registry& registry_;
  const prometheus::Labels rank_;
};

// Per-model training series (rank 0's front end, and every rank's execution
// time) and the RPC counter.
struct TrainingFamilies {
  prometheus::Family<prometheus::Gauge>* grad_norm;
  prometheus::Family<prometheus::Histogram>* grad_norm_distribution;
  prometheus::Family<prometheus::Gauge>* clip_coefficient;
  prometheus::Family<prometheus::Counter>* optim_steps;
  prometheus::Family<prometheus::Counter>* valid_tokens;
  prometheus::Family<prometheus::Counter>* loss_sum;
  prometheus::Family<prometheus::Counter>* samples;
  prometheus::Family<prometheus::Gauge>* pending_tokens;
  prometheus::Family<prometheus::Gauge>* loss;
  prometheus::Family<prometheus::Gauge>* window_loss;
  ServerMetrics::PolicyFamilies policy;
  prometheus::Family<prometheus::Gauge>* model_step;
  prometheus::Family<prometheus::Histogram>* forward_backward_seconds;
  prometheus::Family<prometheus::Histogram>* optim_step_seconds;
  prometheus::Family<prometheus::Counter>* requests;
  prometheus::Family<prometheus::Counter>* sampled_tokens;
  prometheus::Family<prometheus::Histogram>* sample_seconds;
  prometheus::Family<prometheus::Histogram>* sample_first_token_seconds;
  prometheus::Family<prometheus::Histogram>* sample_token_seconds;
  prometheus::Family<prometheus::Gauge>* sample_kv_cache_bytes;
  prometheus::Family<prometheus::Gauge>* sample_active_sequences;
};

TrainingFamilies RegisterTrainingFamilies(FamilyBuilder& build) {
  TrainingFamilies f;
  f.grad_norm = build.Gauge("tally_grad_norm",
                            "Pre-clip global gradient norm of the last step");
  f.grad_norm_distribution =
      build.Histogram("tally_grad_norm_distribution",
                      "Pre-clip global gradient norms (finite ones)");
  f.clip_coefficient =
      build.Gauge("tally_clip_coefficient",
                  "Clip coefficient of the last step (1: not clipped)");
  f.optim_steps =
      build.Counter("tally_optim_steps_total", "OptimStep outcomes");
  f.valid_tokens = build.Counter(
      "tally_valid_tokens_total",
      "Valid tokens of ForwardBackward calls by phase: train (backpropagated) "
      "or eval (forward_only)");
  f.loss_sum = build.Counter(
      "tally_loss_sum_total",
      "Loss sums (w * token loss over the valid tokens) of ForwardBackward "
      "calls by phase: train or eval (forward_only)");
  f.samples =
      build.Counter("tally_samples_total",
                    "Samples with at least one valid token backpropagated");
  f.pending_tokens =
      build.Gauge("tally_pending_tokens", "Valid tokens in the pending window");
  f.loss =
      build.Gauge("tally_loss",
                  "Mean loss of the last ForwardBackward call, train or eval "
                  "(forward_only)");
  f.window_loss = build.Gauge(
      "tally_window_loss",
      "Loss of the last OptimStep's window: its loss sum over the step's "
      "normalizer");
  // Trainer vs sampler policy over the valid tokens of the last
  // ForwardBackward call whose samples carried sampling_logprobs
  // (PolicyStats), one family per unit.
  f.policy[kImportanceRatio] = build.Gauge(
      "tally_policy_importance_ratio",
      "Trainer over sampler token probability of the last RL call, by stat "
      "(mean, min, max)");
  f.policy[kClippedRatio] = build.Gauge(
      "tally_policy_clipped_tokens_ratio",
      "Fraction of the last RL call's valid tokens whose ratio was clipped");
  f.policy[kLogprobGapNats] = build.Gauge(
      "tally_policy_logprob_gap_nats",
      "Trainer vs sampler log-probability gap of the last RL call in nats, by "
      "stat (mean, max)");
  f.policy[kKlNats] = build.Gauge(
      "tally_policy_kl_nats",
      "KL(sampler, trainer) estimate of the last RL call in nats, by "
      "estimator (k1, k3)");
  f.model_step =
      build.Gauge("tally_model_step", "Optimizer steps applied to the model");
  f.forward_backward_seconds =
      build.Histogram("tally_forward_backward_seconds",
                      "ForwardBackward execution time on this rank (by "
                      "model on rank 0, all models together elsewhere)");
  f.optim_step_seconds = build.Histogram(
      "tally_optim_step_seconds",
      "OptimStep execution time on this rank (by model on rank 0, all models "
      "together elsewhere)");
  f.requests =
      build.Counter("tally_requests_total", "RPCs by method and status code");
  f.sampled_tokens = build.Counter("tally_sampled_tokens_total",
                                   "Tokens generated by Sample calls");
  f.sample_seconds = build.Histogram(
      "tally_sample_seconds",
      "Sample execution time on this rank (by model on rank 0, all models "
      "together elsewhere)");
  f.sample_first_token_seconds = build.Histogram(
      "tally_sample_time_to_first_token_seconds",
      "Rank 0: time from a Sample's decode start (prefill included) to its "
      "first token");
  f.sample_token_seconds = build.Histogram(
      "tally_sample_token_seconds",
      "Rank 0: time of each decoding step after the first token (one token "
      "per active sequence)");
  f.sample_kv_cache_bytes =
      build.Gauge("tally_sample_kv_cache_bytes",
                  "Rank 0: KV-cache bytes of the model's running Sample");
  f.sample_active_sequences = build.Gauge(
      "tally_sample_active_sequences",
      "Rank 0: sequences the model's running Sample still decodes on rank 0");
  return f;
}

// This rank's collectives and shard sizes.
struct RankFamilies {
  prometheus::Family<prometheus::Counter>* collective_calls;
  prometheus::Family<prometheus::Counter>* collective_bytes;
  prometheus::Family<prometheus::Gauge>* parameter_bytes;
  prometheus::Family<prometheus::Gauge>* gradient_bytes;
  prometheus::Family<prometheus::Gauge>* optimizer_state_bytes;
};

RankFamilies RegisterRankFamilies(FamilyBuilder& build) {
  RankFamilies f;
  f.collective_calls = build.Counter(
      "tally_collective_calls_total",
      "Collectives this rank took part in, by communicator and op");
  f.collective_bytes = build.Counter(
      "tally_collective_bytes_total",
      "Payload bytes this rank contributed to collectives, by communicator "
      "and op");
  f.parameter_bytes = build.Gauge("tally_rank_parameter_bytes",
                                  "Bytes of this rank's parameter shards");
  f.gradient_bytes = build.Gauge("tally_rank_gradient_bytes",
                                 "Bytes of this rank's gradient shards");
  f.optimizer_state_bytes =
      build.Gauge("tally_rank_optimizer_state_bytes",
                  "Bytes of this rank's optimizer state (AdamW moments)");
  return f;
}

// Retries, poisoned windows, back-pressure, rank failures, checkpoints and
// refused credentials.
struct ReliabilityMetrics {
  prometheus::Family<prometheus::Counter>* duplicate_requests;
  prometheus::Family<prometheus::Counter>* poisoned_windows;
  prometheus::Histogram* seq_gap_wait_seconds;
  prometheus::Gauge* queue_depth;
  prometheus::Family<prometheus::Histogram>* queue_wait_seconds;
  prometheus::Family<prometheus::Gauge>* memory_limit_bytes;
  prometheus::Family<prometheus::Gauge>* memory_admitted_bytes;
  prometheus::Family<prometheus::Counter>* memory_refusals;
  prometheus::Counter* rank_failures;
  prometheus::Family<prometheus::Histogram>* checkpoint_seconds;
  prometheus::Gauge* checkpoint_last_success;
  prometheus::Family<prometheus::Counter>* auth_failures;
};

ReliabilityMetrics RegisterReliabilityMetrics(FamilyBuilder& build) {
  ReliabilityMetrics f;
  f.duplicate_requests =
      build.Counter("tally_duplicate_requests_total",
                    "Retried sequenced requests answered without re-executing");
  f.poisoned_windows = build.Counter(
      "tally_poisoned_windows_total",
      "Accumulation windows poisoned (a failed ForwardBackward, a seq_id gap "
      "timeout)");
  f.seq_gap_wait_seconds =
      &build
           .Histogram("tally_seq_gap_wait_seconds",
                      "How long a missing seq_id held back later requests")
           ->Add({}, SeqGapBuckets());
  f.queue_depth = &build
                       .Gauge("tally_queue_depth",
                              "Requests held: waiting, queued or executing")
                       ->Add({});
  f.queue_wait_seconds = build.Histogram(
      "tally_queue_wait_seconds",
      "Time accepted requests waited before executing, by method (the "
      "execution itself: tally_forward_backward_seconds, "
      "tally_optim_step_seconds)");
  f.memory_limit_bytes = build.Gauge(
      "tally_memory_limit_bytes",
      "Memory admission's limits per rank by scope: server "
      "(--max-memory-bytes) and tenant (--max-memory-bytes-per-tenant); 0: "
      "none");
  f.memory_admitted_bytes = build.Gauge(
      "tally_memory_admitted_bytes",
      "Estimated resident bytes per rank (parameters, gradients, optimizer "
      "state) of the models memory admission holds (rank 0's ledger)");
  f.memory_refusals = build.Counter(
      "tally_memory_refusals_total",
      "CreateModel (refused=model) and ForwardBackward (refused=call) "
      "requests memory admission refused RESOURCE_EXHAUSTED");
  f.rank_failures = &build
                         .Counter("tally_rank_failures_total",
                                  "Collectives that failed or timed out")
                         ->Add({});
  f.checkpoint_seconds = build.Histogram(
      "tally_checkpoint_seconds",
      "Checkpoint save / load / export time by kind (failures included)");
  f.checkpoint_last_success =
      &build
           .Gauge("tally_checkpoint_last_success_timestamp_seconds",
                  "Unix time of the last checkpoint written successfully")
           ->Add({});
  f.auth_failures =
      build.Counter("tally_auth_failures_total",
                    "Requests refused for missing or unknown bearer tokens");
  return f;
}

// The model count, the world size, the ZeRO stage and the build information;
// returns the model count's gauge.
prometheus::Gauge* RegisterServerInfo(FamilyBuilder& build,
                                      const Engine& engine) {
  const Mesh& mesh = engine.mesh();
  prometheus::Gauge* models =
      &build.Gauge("tally_models", "Models loaded")->Add({});
  // A value, not a label, so that alerts can compare it with the number of
  // ranks scraped.
  build.Gauge("tally_world_size", "Ranks in this server's world")
      ->Add({})
      .Set(mesh.world_size());
  build
      .Gauge("tally_zero_stage",
             "What dp_shard shards (--zero-stage): 1 optimizer state, 2 and "
             "gradients, 3 and parameters")
      ->Add({})
      .Set(static_cast<double>(engine.zero_stage()));
  const ComputeBackend backend = DetectComputeBackend();
  build.Gauge("tally_build_info", "Build and rank information (value 1)")
      ->Add({{"version", TALLY_VERSION},
             {"mesh", mesh.shape().ToString()},
             {"blas", std::string(BlasVendorName(backend.blas))},
             {"onednn", backend.onednn ? "true" : "false"}})
      .Set(1);
  build
      .Gauge("tally_compute_threads",
             "Intra-op threads of this rank (LibTorch and the BLAS)")
      ->Add({})
      .Set(backend.threads);
  return models;
}

// Every label value RecordAuthFailure and RecordMemoryRefusal get: rank 0
// creates their series at 0, so dashboards and alerts see 0 before the
// first refusal rather than no data.
constexpr const char* kAuthFailureReasons[] = {"missing_token",
                                               "invalid_token"};
constexpr const char* kMemoryRefusals[] = {"model", "call"};

// What /metrics serves: the registry's families, then other collectables'.
class Collectables : public prometheus::Collectable {
 public:
  explicit Collectables(
      std::vector<std::shared_ptr<prometheus::Collectable>> parts)
      : parts_(std::move(parts)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families;
    for (const auto& part : parts_) {
      std::vector<prometheus::MetricFamily> more = part->Collect();
      families.insert(families.end(), std::make_move_iterator(more.begin()),
                      std::make_move_iterator(more.end()));
    }
    return families;
  }

 private:
  const std::vector<std::shared_ptr<prometheus::Collectable>> parts_;
};

}  // namespace

struct ServerMetrics::ModelSeries {
  prometheus::Gauge* grad_norm;
  prometheus::Histogram* grad_norm_distribution;
  prometheus::Gauge* clip_coefficient;
  prometheus::Counter* steps_applied;
  prometheus::Counter* steps_skipped;
  prometheus::Counter* valid_tokens;  // phase="train"
  prometheus::Counter* samples;
  prometheus::Gauge* pending_tokens;
  prometheus::Gauge* loss;
  prometheus::Gauge* step;
  prometheus::Counter* duplicate_requests;
  prometheus::Counter* poisoned_windows;
  prometheus::Counter* loss_sum;  // phase="train"
  prometheus::Gauge* window_loss;
  // phase="eval": null until the model's first forward_only call, so models
  // never evaluated carry no eval series.
  prometheus::Counter* eval_valid_tokens;
  prometheus::Counter* eval_loss_sum;
  // The tally_policy_* series by kPolicyStats' order: NaN until the model's
  // first call with sampling_logprobs.
  std::vector<prometheus::Gauge*> policy;
  // The loss of the pending window so far (WindowLossTerm of each call):
  // what tally_window_loss divides by the step's normalizer.
  double window_loss_sum;
  // Null until the model's first Sample, so models never sampled carry no
  // sampling series.
  prometheus::Counter* sampled_tokens;
  // Null until the model's first decode reports (ObserveDecodeProgress).
  prometheus::Histogram* first_token_seconds;
  prometheus::Histogram* token_seconds;
  prometheus::Gauge* kv_cache_bytes;
  prometheus::Gauge* active_sequences;
};

struct ServerMetrics::RankModelSeries {
  prometheus::Histogram* forward_backward_seconds;
  prometheus::Histogram* optim_step_seconds;
  prometheus::Histogram* sample_seconds;  // null until the first Sample
  prometheus::Gauge* parameter_bytes;
  prometheus::Gauge* gradient_bytes;
  prometheus::Gauge* optimizer_state_bytes;
};

// Prometheus counters only go up, so the communicator's totals are added as
// increments since the last copy.
struct ServerMetrics::CommSeries {
  prometheus::Counter* calls;
  prometheus::Counter* bytes;
  CommCounter copied;
};

ServerMetrics::~ServerMetrics() = default;

absl::StatusOr<std::unique_ptr<ServerMetrics>> ServerMetrics::Create(
    const std::string& address, Engine* engine,
    std::optional<BasicCredentials> scraper) {
  std::unique_ptr<ServerMetrics> m(new ServerMetrics());
  m->engine_ = engine;
  m->registry_ = std::make_shared<prometheus::Registry>();
  FamilyBuilder build(*m->registry_, engine->mesh().rank());
  // Registered in this order (the order of /metrics).
  const TrainingFamilies training = RegisterTrainingFamilies(build);
  m->grad_norm_ = training.grad_norm;
  m->grad_norm_distribution_ = training.grad_norm_distribution;
  m->clip_coefficient_ = training.clip_coefficient;
  m->optim_steps_ = training.optim_steps;
  m->valid_tokens_ = training.valid_tokens;
  m->loss_sum_ = training.loss_sum;
  m->samples_ = training.samples;
  m->pending_tokens_ = training.pending_tokens;
  m->loss_ = training.loss;
  m->window_loss_ = training.window_loss;
  m->policy_ = training.policy;
  m->model_step_ = training.model_step;
  m->forward_backward_seconds_ = training.forward_backward_seconds;
  m->optim_step_seconds_ = training.optim_step_seconds;
  m->requests_ = training.requests;
  m->sampled_tokens_ = training.sampled_tokens;
  m->sample_seconds_ = training.sample_seconds;
  m->sample_first_token_seconds_ = training.sample_first_token_seconds;
  m->sample_token_seconds_ = training.sample_token_seconds;
  m->sample_kv_cache_bytes_ = training.sample_kv_cache_bytes;
  m->sample_active_sequences_ = training.sample_active_sequences;
  const RankFamilies rank = RegisterRankFamilies(build);
  m->collective_calls_ = rank.collective_calls;
  m->collective_bytes_ = rank.collective_bytes;
  m->parameter_bytes_ = rank.parameter_bytes;
  m->gradient_bytes_ = rank.gradient_bytes;
  m->optimizer_state_bytes_ = rank.optimizer_state_bytes;
  const ReliabilityMetrics reliability = RegisterReliabilityMetrics(build);
  m->duplicate_requests_ = reliability.duplicate_requests;
  m->poisoned_windows_ = reliability.poisoned_windows;
  m->seq_gap_wait_seconds_ = reliability.seq_gap_wait_seconds;
  m->queue_depth_ = reliability.queue_depth;
  m->queue_wait_seconds_ = reliability.queue_wait_seconds;
  m->memory_limit_bytes_ = reliability.memory_limit_bytes;
  m->memory_admitted_bytes_ = reliability.memory_admitted_bytes;
  m->memory_refusals_ = reliability.memory_refusals;
  m->rank_failures_ = reliability.rank_failures;
  m->checkpoint_seconds_ = reliability.checkpoint_seconds;
  m->checkpoint_last_success_ = reliability.checkpoint_last_success;
  m->auth_failures_ = reliability.auth_failures;
  m->models_ = RegisterServerInfo(build, *engine);
  if (engine->mesh().rank() == 0) m->StartRequestSeriesAtZero();
  auto served = std::make_shared<Collectables>(
      std::vector<std::shared_ptr<prometheus::Collectable>>{
          m->registry_, std::make_shared<ProcessMetrics>(prometheus::Labels{
                            {"rank", absl::StrCat(engine->mesh().rank())}})});
  TALLY_ASSIGN_OR_RETURN(
      m->http_,
      HttpEndpoint::Start(address, std::move(served), std::move(scraper)));
  absl::MutexLock lock(&m->mu_);
  m->RecordRankStateLocked();
  return m;
}

void ServerMetrics::StartRequestSeriesAtZero() {
  for (const char* reason : kAuthFailureReasons) {
    auth_failures_->Add({{"reason", reason}});
  }
  for (const char* refused : kMemoryRefusals) {
    memory_refusals_->Add({{"refused", refused}});
  }
  memory_admitted_bytes_->Add({});
  // Every RPC's OK count, so that request rates start from 0.
  const google::protobuf::ServiceDescriptor* trainer =
      v1::ModelInfo::descriptor()->file()->FindServiceByName("Trainer");
  for (int i = 0; i < trainer->method_count(); ++i) {
    requests_->Add({{"method", trainer->method(i)->name()},
                    {"code", absl::StatusCodeToString(absl::StatusCode::kOk)}});
  }
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
    slot = std::make_unique<ModelSeries>(
        ModelSeries{&grad_norm_->Add(l),
                    &grad_norm_distribution_->Add(l, GradNormBuckets()),
                    &clip_coefficient_->Add(l),
                    &optim_steps_->Add(with("outcome", "applied")),
                    &optim_steps_->Add(with("outcome", "skipped_nonfinite")),
                    &valid_tokens_->Add(PhaseLabels(id, "train")),
                    &samples_->Add(l),
                    &pending_tokens_->Add(l),
                    &loss_->Add(l),
                    &model_step_->Add(l),
                    &duplicate_requests_->Add(l),
                    &poisoned_windows_->Add(l),
                    &loss_sum_->Add(PhaseLabels(id, "train")),
                    &window_loss_->Add(l),
                    /*eval_valid_tokens=*/nullptr,
                    /*eval_loss_sum=*/nullptr,
                    PolicySeries(id),
                    /*window_loss_sum=*/0.0,
                    /*sampled_tokens=*/nullptr,
                    /*first_token_seconds=*/nullptr,
                    /*token_seconds=*/nullptr,
                    /*kv_cache_bytes=*/nullptr,
                    /*active_sequences=*/nullptr});
  }
  return *slot;
}

prometheus::Labels ServerMetrics::TimingLabels(const std::string& id) const {
  if (engine_->mesh().rank() == 0) return {{"model_id", id}};
  return {};
}

ServerMetrics::RankModelSeries& ServerMetrics::RankSeries(
    const std::string& id) {
  auto& slot = rank_series_[id];
  if (!slot) {
    const prometheus::Labels l = {{"model_id", id}};
    slot = std::make_unique<RankModelSeries>(RankModelSeries{
        &forward_backward_seconds_->Add(TimingLabels(id), CommandBuckets()),
        &optim_step_seconds_->Add(TimingLabels(id), CommandBuckets()),
        /*sample_seconds=*/nullptr, &parameter_bytes_->Add(l),
        &gradient_bytes_->Add(l), &optimizer_state_bytes_->Add(l)});
  }
  return *slot;
}

void ServerMetrics::RecordRequest(const std::string& method,
                                  const std::string& code) {
  requests_->Add({{"method", method}, {"code", code}}).Increment();
}

void ServerMetrics::RecordForwardBackward(
    const std::string& model_id, const v1::ForwardBackwardResponse& result,
    bool accumulated, v1::LossReduction reduction, double seconds) {
  absl::MutexLock lock(&mu_);
  RankSeries(model_id).forward_backward_seconds->Observe(seconds);
  ModelSeries& s = Series(model_id);
  s.loss->Set(result.loss_mean());
  if (!accumulated && s.eval_valid_tokens == nullptr) {
    s.eval_valid_tokens = &valid_tokens_->Add(PhaseLabels(model_id, "eval"));
    s.eval_loss_sum = &loss_sum_->Add(PhaseLabels(model_id, "eval"));
  }
  // The response's loss_sum and valid_tokens are the sums over its samples.
  (accumulated ? s.valid_tokens : s.eval_valid_tokens)
      ->Increment(static_cast<double>(result.valid_tokens()));
  // A counter never recovers from NaN or Inf: a non-finite call adds nothing
  // to the loss sum (tally_loss and tally_window_loss show it).
  if (std::isfinite(result.loss_sum())) {
    (accumulated ? s.loss_sum : s.eval_loss_sum)->Increment(result.loss_sum());
  }
  if (result.has_policy()) RecordPolicy(result.policy(), s);
  if (accumulated) {
    s.samples->Increment(static_cast<double>(result.num_samples()));
    s.pending_tokens->Set(static_cast<double>(result.accumulated_tokens()));
    s.window_loss_sum += WindowLossTerm(result, reduction);
  }
  RecordRankStateLocked();
}

std::vector<prometheus::Gauge*> ServerMetrics::PolicySeries(
    const std::string& model_id) {
  std::vector<prometheus::Gauge*> series;
  for (const PolicyStat& stat : kPolicyStats) {
    prometheus::Labels labels = {{"model_id", model_id}};
    if (stat.label != nullptr) labels[stat.label] = stat.value_label;
    series.push_back(&policy_[stat.family]->Add(labels));
    series.back()->Set(std::numeric_limits<double>::quiet_NaN());
  }
  return series;
}

void ServerMetrics::RecordPolicy(const v1::PolicyStats& policy,
                                 ModelSeries& s) {
  // A call without valid tokens has no statistics to show.
  if (policy.tokens() == 0) return;
  for (size_t i = 0; i < std::size(kPolicyStats); ++i) {
    s.policy[i]->Set((policy.*kPolicyStats[i].value)());
  }
}

void ServerMetrics::RecordOptimStep(const std::string& model_id,
                                    const v1::OptimStepResponse& result,
                                    double seconds) {
  absl::MutexLock lock(&mu_);
  RankSeries(model_id).optim_step_seconds->Observe(seconds);
  ModelSeries& s = Series(model_id);
  s.grad_norm->Set(result.grad_norm());
  if (std::isfinite(result.grad_norm())) {
    s.grad_norm_distribution->Observe(result.grad_norm());
  }
  s.clip_coefficient->Set(result.clip_coef());
  (result.skipped() ? s.steps_skipped : s.steps_applied)->Increment();
  s.step->Set(static_cast<double>(result.step()));
  s.pending_tokens->Set(0);
  // Applied or skipped, the step consumed the window (normalizer > 0).
  s.window_loss->Set(s.window_loss_sum / result.normalizer());
  s.window_loss_sum = 0.0;
  RecordRankStateLocked();
}

void ServerMetrics::ObserveForwardBackwardSeconds(const std::string& model_id,
                                                  double seconds) {
  absl::MutexLock lock(&mu_);
  RankSeries(model_id).forward_backward_seconds->Observe(seconds);
  RecordRankStateLocked();
}

void ServerMetrics::ObserveOptimStepSeconds(const std::string& model_id,
                                            double seconds) {
  absl::MutexLock lock(&mu_);
  RankSeries(model_id).optim_step_seconds->Observe(seconds);
  RecordRankStateLocked();
}

prometheus::Histogram& ServerMetrics::SampleSeconds(
    const std::string& model_id) {
  RankModelSeries& s = RankSeries(model_id);
  if (s.sample_seconds == nullptr) {
    s.sample_seconds =
        &sample_seconds_->Add(TimingLabels(model_id), CommandBuckets());
  }
  return *s.sample_seconds;
}

void ServerMetrics::RecordSample(const std::string& model_id, int64_t tokens,
                                 double seconds) {
  absl::MutexLock lock(&mu_);
  SampleSeconds(model_id).Observe(seconds);
  ModelSeries& s = Series(model_id);
  if (s.sampled_tokens == nullptr) {
    s.sampled_tokens = &sampled_tokens_->Add({{"model_id", model_id}});
  }
  s.sampled_tokens->Increment(static_cast<double>(tokens));
  RecordRankStateLocked();
}

void ServerMetrics::ObserveDecodeProgress(const std::string& model_id,
                                          const DecodeStats& stats) {
  absl::MutexLock lock(&mu_);
  ModelSeries& s = Series(model_id);
  if (s.first_token_seconds == nullptr) {
    const prometheus::Labels l = {{"model_id", model_id}};
    s.first_token_seconds =
        &sample_first_token_seconds_->Add(l, CommandBuckets());
    s.token_seconds = &sample_token_seconds_->Add(l, TokenBuckets());
    s.kv_cache_bytes = &sample_kv_cache_bytes_->Add(l);
    s.active_sequences = &sample_active_sequences_->Add(l);
  }
  if (stats.step == 1) s.first_token_seconds->Observe(stats.step_seconds);
  if (stats.step > 1) s.token_seconds->Observe(stats.step_seconds);
  s.kv_cache_bytes->Set(static_cast<double>(stats.cache_bytes));
  s.active_sequences->Set(static_cast<double>(stats.active_sequences));
}

void ServerMetrics::ObserveSampleSeconds(const std::string& model_id,
                                         double seconds) {
  absl::MutexLock lock(&mu_);
  SampleSeconds(model_id).Observe(seconds);
  RecordRankStateLocked();
}

void ServerMetrics::SetPendingTokens(const std::string& model_id,
                                     int64_t tokens) {
  absl::MutexLock lock(&mu_);
  ModelSeries& s = Series(model_id);
  s.pending_tokens->Set(static_cast<double>(tokens));
  // An empty window has no loss (a call without valid tokens adds none).
  if (tokens == 0) s.window_loss_sum = 0.0;
  RecordRankStateLocked();
}

void ServerMetrics::RecordCheckpoint(const std::string& kind, bool ok,
                                     double seconds) {
  checkpoint_seconds_->Add({{"kind", kind}}, CheckpointBuckets())
      .Observe(seconds);
  if (ok && (kind == "save" || kind == "periodic" || kind == "exit")) {
    checkpoint_last_success_->SetToCurrentTime();
  }
}

void ServerMetrics::RecordAuthFailure(const std::string& reason) {
  auth_failures_->Add({{"reason", reason}}).Increment();
}

void ServerMetrics::SetModelCount(size_t count) {
  models_->Set(static_cast<double>(count));
  absl::MutexLock lock(&mu_);
  RecordRankStateLocked();
}

void ServerMetrics::RemoveModel(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  RemoveRankSeries(model_id);
  RemoveModelSeries(model_id);
}

void ServerMetrics::RemoveModelSeries(const std::string& model_id) {
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
  duplicate_requests_->Remove(s.duplicate_requests);
  poisoned_windows_->Remove(s.poisoned_windows);
  loss_sum_->Remove(s.loss_sum);
  window_loss_->Remove(s.window_loss);
  for (size_t i = 0; i < std::size(kPolicyStats); ++i) {
    policy_[kPolicyStats[i].family]->Remove(s.policy[i]);
  }
  if (s.eval_valid_tokens != nullptr) {
    valid_tokens_->Remove(s.eval_valid_tokens);
    loss_sum_->Remove(s.eval_loss_sum);
  }
  if (s.sampled_tokens != nullptr) sampled_tokens_->Remove(s.sampled_tokens);
  if (s.first_token_seconds != nullptr) {
    sample_first_token_seconds_->Remove(s.first_token_seconds);
    sample_token_seconds_->Remove(s.token_seconds);
    sample_kv_cache_bytes_->Remove(s.kv_cache_bytes);
    sample_active_sequences_->Remove(s.active_sequences);
  }
  series_.erase(it);
}

void ServerMetrics::RemoveRankSeries(const std::string& model_id) {
  auto it = rank_series_.find(model_id);
  if (it == rank_series_.end()) return;
  const RankModelSeries& s = *it->second;
  if (!TimingLabels(model_id).empty()) {  // not the rank's shared series
    forward_backward_seconds_->Remove(s.forward_backward_seconds);
    optim_step_seconds_->Remove(s.optim_step_seconds);
    if (s.sample_seconds != nullptr) {
      sample_seconds_->Remove(s.sample_seconds);
    }
  }
  parameter_bytes_->Remove(s.parameter_bytes);
  gradient_bytes_->Remove(s.gradient_bytes);
  optimizer_state_bytes_->Remove(s.optimizer_state_bytes);
  rank_series_.erase(it);
}

void ServerMetrics::RecordRankState() {
  absl::MutexLock lock(&mu_);
  RecordRankStateLocked();
}

void ServerMetrics::WatchDeviceMemory(const torch::Device& device) {
  if (!device.is_cuda()) return;
  absl::MutexLock lock(&mu_);
  device_memory_ = std::make_unique<DeviceMemoryGauges>(
      *registry_,
      prometheus::Labels{{"rank", absl::StrCat(engine_->mesh().rank())}},
      device);
  device_memory_->Update();
}

void ServerMetrics::RecordRankStateLocked() {
  if (device_memory_) device_memory_->Update();
  for (const auto& [roles, comm] : NamedCommunicators(*engine_)) {
    for (int i = 0; i < kNumCommOps; ++i) {
      const auto op = static_cast<CommOp>(i);
      const CommCounter& now = comm->stats().Get(op);
      const std::string key = absl::StrCat(roles, "/", CommOpName(op));
      // Ops a communicator never ran get no series (most pairs of the 6x6),
      // except the world's, which start at 0 (the dashboard's traffic).
      const bool world =
          absl::StrContains(absl::StrCat("+", roles, "+"), "+world+");
      if (now.calls == 0 && !world && comm_series_.count(key) == 0) continue;
      auto& slot = comm_series_[key];
      if (!slot) {
        const prometheus::Labels l = {{"communicator", roles},
                                      {"op", CommOpName(op)}};
        slot = std::make_unique<CommSeries>(CommSeries{
            &collective_calls_->Add(l), &collective_bytes_->Add(l), {}});
      }
      // CommStats only grow once the metrics exist (the rendezvous resets
      // the world's before); Increment ignores a negative step.
      slot->calls->Increment(
          static_cast<double>(now.calls - slot->copied.calls));
      slot->bytes->Increment(
          static_cast<double>(now.bytes - slot->copied.bytes));
      slot->copied = now;
    }
  }
  std::set<std::string> live;
  for (const ModelSummary& summary : engine_->ListModels()) {
    live.insert(summary.model_id);
    // Rank 0's request-level series exist as soon as the model does (a
    // --demo-model or a resumed one included), before its first request.
    if (engine_->mesh().rank() == 0) Series(summary.model_id);
    absl::StatusOr<const CausalLm*> model = engine_->model(summary.model_id);
    if (!model.ok()) continue;
    // The shards, and under ZeRO-1/2 the gathered copies (and ZeRO-1's
    // whole gradients) besides.
    const std::vector<Parameter>& params = (*model)->parameters();
    const GatheredBytes gathered = GatheredStateBytes(params);
    int64_t trainable_shards = 0;
    double parameters = gathered.parameters, gradients = gathered.gradients;
    for (const Parameter& p : params) {
      parameters += static_cast<double>(TensorBytes(p.tensor));
      gradients += static_cast<double>(TensorBytes(p.tensor.grad()));
      if (p.trainable) trainable_shards += TensorBytes(p.tensor);
    }
    RankModelSeries& s = RankSeries(summary.model_id);
    s.parameter_bytes->Set(parameters);
    s.gradient_bytes->Set(gradients);
    // AdamW keeps two moments shaped like the trainable shards from creation
    // on; SGD keeps none.
    s.optimizer_state_bytes->Set(summary.optimizer == OptimizerKind::kAdamW
                                     ? 2.0 * trainable_shards
                                     : 0.0);
  }
  models_->Set(static_cast<double>(live.size()));
  std::vector<std::string> gone;
  for (const auto& [id, series] : rank_series_) {
    if (live.count(id) == 0) gone.push_back(id);
  }
  for (const std::string& id : gone) RemoveRankSeries(id);
  gone.clear();
  for (const auto& [id, series] : series_) {
    if (live.count(id) == 0) gone.push_back(id);
  }
  for (const std::string& id : gone) RemoveModelSeries(id);
}

void ServerMetrics::RecordDuplicate(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  Series(model_id).duplicate_requests->Increment();
}

void ServerMetrics::RecordPoisonedWindow(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  Series(model_id).poisoned_windows->Increment();
}

void ServerMetrics::RecordSeqGapWait(double seconds) {
  seq_gap_wait_seconds_->Observe(seconds);
}

void ServerMetrics::SetQueueDepth(size_t depth) {
  queue_depth_->Set(static_cast<double>(depth));
}

void ServerMetrics::ObserveQueueWait(const std::string& method,
                                     double seconds) {
  queue_wait_seconds_->Add({{"method", method}}, CommandBuckets())
      .Observe(seconds);
}

void ServerMetrics::SetMemoryLimits(double limit_bytes,
                                    double per_tenant_bytes) {
  memory_limit_bytes_->Add({{"scope", "server"}}).Set(limit_bytes);
  memory_limit_bytes_->Add({{"scope", "tenant"}}).Set(per_tenant_bytes);
}

void ServerMetrics::SetMemoryAdmitted(double bytes) {
  memory_admitted_bytes_->Add({}).Set(bytes);
}

void ServerMetrics::RecordMemoryRefusal(const std::string& refused) {
  memory_refusals_->Add({{"refused", refused}}).Increment();
}

void ServerMetrics::RecordRankFailure() { rank_failures_->Increment(); }

}  // namespace tally
