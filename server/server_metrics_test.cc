// ServerMetrics' rank state, scraped over HTTP from a single-rank engine: the
// shard sizes against the model's own tensors, the collective counters
// against the communicator's CommStats, and the series of a deleted model
// gone. Also the loss series against the engine's results (train and eval
// apart, the window's normalized loss, the RL policy statistics) and the
// latency histograms' buckets.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "gtest/gtest.h"
#include "server/convert.h"
#include "server/metrics.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::MakeSamples;
using testing::TinySpec;

// GET /metrics from 127.0.0.1:port; empty on any failure.
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
    const std::string request =
        "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd, request.data(), request.size()) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[65536];
      for (ssize_t n; (n = read(fd, buffer, sizeof buffer)) > 0;) {
        response.append(buffer, static_cast<size_t>(n));
      }
    }
  }
  close(fd);
  return response;
}

// The value of the sample line that starts with `series` exactly (name and
// the full label set as prometheus-cpp prints it), or -1.
double Value(const std::string& text, const std::string& series) {
  const std::string prefix = "\n" + series + " ";
  const size_t at = text.find(prefix);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + prefix.size()));
}

// The finite `le` bounds of the histogram series whose bucket lines start
// with `prefix` (name, "_bucket{" and every label before le), in order.
std::vector<double> FiniteBounds(const std::string& text,
                                 const std::string& prefix) {
  std::vector<double> bounds;
  const std::string start = "\n" + prefix + "le=\"";
  for (size_t at = text.find(start); at != std::string::npos;
       at = text.find(start, at + 1)) {
    const size_t from = at + start.size();
    const std::string le = text.substr(from, text.find('"', from) - from);
    if (le != "+Inf") bounds.push_back(std::stod(le));
  }
  return bounds;
}

int64_t Bytes(CausalLm& model, bool gradients) {
  int64_t total = 0;
  for (const Parameter& p : model.parameters()) {
    const torch::Tensor& t = gradients ? p.tensor.grad() : p.tensor;
    if (t.defined()) total += t.numel() * t.element_size();
  }
  return total;
}

// Rank 0 starts every refusal counter a dashboard or alert plots at 0, one
// series per reason, and counts from there; /metrics also carries the
// process_* series.
TEST(ServerMetricsTest, RefusalCountersStartAtZero) {
  auto engine = Engine::CreateSingleRank({});
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto metrics = ServerMetrics::Create("127.0.0.1:0", engine->get());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const std::string auth = "tally_auth_failures_total{rank=\"0\",reason=";
  const std::string memory = "tally_memory_refusals_total{rank=\"0\",refused=";
  std::string text = Scrape((*metrics)->port());
  EXPECT_EQ(Value(text, auth + "\"missing_token\"}"), 0) << text;
  EXPECT_EQ(Value(text, auth + "\"invalid_token\"}"), 0) << text;
  EXPECT_EQ(Value(text, memory + "\"model\"}"), 0) << text;
  EXPECT_EQ(Value(text, memory + "\"call\"}"), 0) << text;
  EXPECT_EQ(Value(text, "tally_memory_admitted_bytes{rank=\"0\"}"), 0);
  EXPECT_GT(Value(text, "process_resident_memory_bytes{rank=\"0\"}"), 0);

  (*metrics)->RecordAuthFailure("invalid_token");
  (*metrics)->RecordMemoryRefusal("call");
  text = Scrape((*metrics)->port());
  EXPECT_EQ(Value(text, auth + "\"missing_token\"}"), 0);
  EXPECT_EQ(Value(text, auth + "\"invalid_token\"}"), 1);
  EXPECT_EQ(Value(text, memory + "\"model\"}"), 0);
  EXPECT_EQ(Value(text, memory + "\"call\"}"), 1);
}

TEST(ServerMetricsTest, RankStateFollowsTheEngine) {
  auto engine = Engine::CreateSingleRank({});
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto metrics = ServerMetrics::Create("127.0.0.1:0", engine->get());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const int port = (*metrics)->port();
  Engine& e = **engine;
  ASSERT_TRUE(
      e.CreateModel(TinySpec("m", DType::kFloat32, OptimizerKind::kAdamW))
          .ok());
  (*metrics)->RecordRankState();

  CausalLm* model = *EngineTestPeer::Model(e, "m");
  const int64_t parameter_bytes = Bytes(*model, false);
  std::string text = Scrape(port);
  EXPECT_EQ(Value(text, "tally_models{rank=\"0\"}"), 1);
  EXPECT_EQ(Value(text, "tally_world_size{rank=\"0\"}"), 1);
  EXPECT_EQ(Value(text, "tally_zero_stage{rank=\"0\"}"),
            static_cast<double>(e.zero_stage()));
  EXPECT_EQ(
      Value(text, "tally_rank_parameter_bytes{rank=\"0\",model_id=\"m\"}"),
      parameter_bytes);
  EXPECT_EQ(Value(text, "tally_rank_gradient_bytes{rank=\"0\",model_id=\"m\"}"),
            0);
  EXPECT_EQ(Value(text,
                  "tally_rank_optimizer_state_bytes{rank=\"0\","
                  "model_id=\"m\"}"),
            2 * parameter_bytes);

  const int64_t vocab =
      TinySpec("m", DType::kFloat32, OptimizerKind::kAdamW).config.vocab_size;
  ForwardBackwardArgs args{MakeSamples(vocab, {3, 5}, 7)};
  ASSERT_TRUE(e.ForwardBackward("m", args).ok());
  (*metrics)->ObserveForwardBackwardSeconds("m", 0.25);
  text = Scrape(port);
  EXPECT_GT(Bytes(*model, true), 0);
  EXPECT_EQ(Value(text, "tally_rank_gradient_bytes{rank=\"0\",model_id=\"m\"}"),
            Bytes(*model, true));
  EXPECT_EQ(Value(text,
                  "tally_forward_backward_seconds_count{rank=\"0\","
                  "model_id=\"m\"}"),
            1);
  EXPECT_EQ(Value(text,
                  "tally_forward_backward_seconds_sum{rank=\"0\","
                  "model_id=\"m\"}"),
            0.25);

  // The step's norm is all-reduced even over one rank (the real code path).
  ASSERT_TRUE(e.OptimStep("m", {}).ok());
  (*metrics)->RecordRankState();
  const CommCounter first = e.world().stats().Get(CommOp::kAllReduce);
  ASSERT_GT(first.calls, 0);
  // A single-rank engine uses one communicator for every role.
  const std::string all_reduce =
      "{rank=\"0\",communicator=\"world+data+data_and_cp+replicas+"
      "dp_replicate+dp_shard+cp+tp+ep+expert_replicas+pp+control\",op=\"all_"
      "reduce\"}";
  text = Scrape(port);
  EXPECT_EQ(Value(text, "tally_collective_calls_total" + all_reduce),
            first.calls);
  EXPECT_EQ(Value(text, "tally_collective_bytes_total" + all_reduce),
            first.bytes);

  // The next step's collectives add to the counter.
  ASSERT_TRUE(e.ForwardBackward("m", args).ok());
  ASSERT_TRUE(e.OptimStep("m", {}).ok());
  (*metrics)->RecordRankState();
  const CommCounter second = e.world().stats().Get(CommOp::kAllReduce);
  ASSERT_GT(second.calls, first.calls);
  text = Scrape(port);
  EXPECT_EQ(Value(text, "tally_collective_calls_total" + all_reduce),
            second.calls);
  EXPECT_EQ(Value(text, "tally_collective_bytes_total" + all_reduce),
            second.bytes);

  ASSERT_TRUE(e.DeleteModel("m").ok());
  (*metrics)->RecordRankState();
  text = Scrape(port);
  EXPECT_EQ(text.find("model_id=\"m\""), std::string::npos) << text;
  EXPECT_EQ(Value(text, "tally_models{rank=\"0\"}"), 0);
}

// Exit checkpoints (--checkpoint-on-exit) are writes: timed under their own
// kind and, when they succeed, the last successful checkpoint; a failed one
// or a load is not.
TEST(ServerMetricsTest, ExitCheckpointsAreSuccessfulWrites) {
  auto engine = Engine::CreateSingleRank({});
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto metrics = ServerMetrics::Create("127.0.0.1:0", engine->get());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const std::string last_success =
      "tally_checkpoint_last_success_timestamp_seconds{rank=\"0\"}";
  (*metrics)->RecordCheckpoint("exit", /*ok=*/false, 0.5);
  (*metrics)->RecordCheckpoint("load", /*ok=*/true, 0.25);
  std::string text = Scrape((*metrics)->port());
  EXPECT_EQ(
      Value(text, "tally_checkpoint_seconds_count{rank=\"0\",kind=\"exit\"}"),
      1);
  EXPECT_EQ(
      Value(text, "tally_checkpoint_seconds_sum{rank=\"0\",kind=\"exit\"}"),
      0.5);
  EXPECT_EQ(Value(text, last_success), 0);
  const double before = absl::ToUnixSeconds(absl::Now());
  (*metrics)->RecordCheckpoint("exit", /*ok=*/true, 0.25);
  text = Scrape((*metrics)->port());
  EXPECT_EQ(
      Value(text, "tally_checkpoint_seconds_count{rank=\"0\",kind=\"exit\"}"),
      2);
  EXPECT_GE(Value(text, last_success), before);
}

// tally_loss_sum_total and tally_valid_tokens_total move by exactly each
// call's sums over its samples, train (accumulating) and eval (forward_only)
// apart; tally_loss is the last call's mean, eval included; tally_window_loss
// is the window's loss over the step's normalizer, and an aborted window
// leaves nothing in the next one.
// A single-rank engine holding model "m" (TinySpec, float32) and the
// metrics of it, scraped on a free port.
class ModelMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = Engine::CreateSingleRank({}).value();
    metrics_ = ServerMetrics::Create("127.0.0.1:0", engine_.get()).value();
    const ModelSpec spec =
        TinySpec("m", DType::kFloat32, OptimizerKind::kAdamW);
    ASSERT_TRUE(engine_->CreateModel(spec).ok());
    metrics_->SetPendingTokens("m", 0);  // what CreateModel records
    vocab_ = spec.config.vocab_size;
  }

  // Runs a call on the engine and records it as the server's command does.
  v1::ForwardBackwardResponse Call(const ForwardBackwardArgs& args) {
    absl::StatusOr<ForwardBackwardResult> result =
        engine_->ForwardBackward("m", args);
    EXPECT_TRUE(result.ok()) << result.status();
    v1::ForwardBackwardResponse response;
    if (result.ok()) ToProto(*result, &response);
    metrics_->RecordForwardBackward(
        "m", response, !args.forward_only,
        ToProto(std::optional<LossReduction>(args.reduction)), 0.5);
    return response;
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ServerMetrics> metrics_;
  int64_t vocab_ = 0;
};

TEST_F(ModelMetricsTest, LossSumsByPhaseAndTheWindowLoss) {
  Engine& e = *engine_;
  ServerMetrics& m = *metrics_;
  const int64_t vocab = vocab_;
  auto call = [&](std::vector<Sample> samples, LossReduction reduction,
                  bool forward_only) {
    return Call({std::move(samples), reduction, forward_only});
  };
  auto step = [&] {
    absl::StatusOr<OptimStepResult> result = e.OptimStep("m", {});
    EXPECT_TRUE(result.ok()) << result.status();
    v1::OptimStepResponse response;
    if (result.ok()) ToProto(*result, &response);
    m.RecordOptimStep("m", response, 0.5);
    return response;
  };
  // Sums by hand over the samples the responses carry, call by call (the
  // order the metrics add them in, so that the doubles agree exactly).
  struct Sums {
    double loss = 0;
    int64_t tokens = 0;
    double sample_means = 0;  // of the samples with a valid token
    int64_t samples = 0;
  };
  auto add = [](Sums& sums, const v1::ForwardBackwardResponse& r) {
    double loss = 0, sample_means = 0;
    for (const v1::SampleResult& sample : r.samples()) {
      loss += sample.loss_sum();
      sums.tokens += sample.valid_tokens();
      if (sample.valid_tokens() > 0) {
        sample_means += sample.loss_sum() / sample.valid_tokens();
        ++sums.samples;
      }
    }
    sums.loss += loss;
    sums.sample_means += sample_means;
  };
  const std::string train = "{rank=\"0\",model_id=\"m\",phase=\"train\"}";
  const std::string eval = "{rank=\"0\",model_id=\"m\",phase=\"eval\"}";
  const std::string model = "{rank=\"0\",model_id=\"m\"}";
  // prometheus-cpp prints 16 significant digits: a relative error <= 5e-16.
  auto expect_value = [](const std::string& text, const std::string& series,
                         double expected) {
    EXPECT_NEAR(Value(text, series), expected, 1e-15 * std::abs(expected))
        << series;
  };

  std::string text = Scrape(m.port());
  EXPECT_EQ(Value(text, "tally_loss_sum_total" + train), 0);
  EXPECT_EQ(Value(text, "tally_valid_tokens_total" + train), 0);
  // A model never evaluated has no eval series.
  EXPECT_EQ(text.find("phase=\"eval\""), std::string::npos) << text;

  Sums trained;
  Sums window;
  for (const v1::ForwardBackwardResponse& r :
       {call(MakeSamples(vocab, {3, 5}, 7), LossReduction::kTokenMean, false),
        call(MakeSamples(vocab, {4, 0, 6}, 8), LossReduction::kTokenMean,
             false)}) {
    add(trained, r);
    add(window, r);
  }
  ASSERT_GT(window.loss, 0);
  ASSERT_EQ(window.tokens, 18);
  const v1::ForwardBackwardResponse evaluated =
      call(MakeSamples(vocab, {2, 9}, 9), LossReduction::kTokenMean, true);
  Sums evaluated_sums;
  add(evaluated_sums, evaluated);
  ASSERT_GT(evaluated_sums.loss, 0);
  ASSERT_EQ(evaluated_sums.tokens, 11);
  text = Scrape(m.port());
  expect_value(text, "tally_loss_sum_total" + train, trained.loss);
  EXPECT_EQ(Value(text, "tally_valid_tokens_total" + train), trained.tokens);
  expect_value(text, "tally_loss_sum_total" + eval, evaluated_sums.loss);
  EXPECT_EQ(Value(text, "tally_valid_tokens_total" + eval),
            evaluated_sums.tokens);
  // The eval call's tokens are not in the window.
  EXPECT_EQ(Value(text, "tally_pending_tokens" + model), window.tokens);
  expect_value(text, "tally_loss" + model, evaluated.loss_mean());

  v1::OptimStepResponse stepped = step();
  ASSERT_FALSE(stepped.skipped());
  ASSERT_EQ(stepped.normalizer(), static_cast<double>(window.tokens));
  text = Scrape(m.port());
  expect_value(text, "tally_window_loss" + model,
               window.loss / static_cast<double>(window.tokens));

  // A call whose window is aborted (its counters stay), then a SAMPLE_MEAN
  // window: the mean over its counted samples of their token means.
  add(trained,
      call(MakeSamples(vocab, {7}, 10), LossReduction::kTokenMean, false));
  ASSERT_TRUE(e.AbortAccumulation("m").ok());
  m.SetPendingTokens("m", 0);  // what AbortAccumulation records
  window = Sums();
  for (const v1::ForwardBackwardResponse& r :
       {call(MakeSamples(vocab, {3, 0, 8}, 11), LossReduction::kSampleMean,
             false),
        call(MakeSamples(vocab, {5}, 12), LossReduction::kSampleMean, false)}) {
    add(trained, r);
    add(window, r);
  }
  ASSERT_EQ(window.samples, 3);
  stepped = step();
  ASSERT_FALSE(stepped.skipped());
  ASSERT_EQ(stepped.normalizer(), static_cast<double>(window.samples));
  text = Scrape(m.port());
  expect_value(text, "tally_window_loss" + model,
               window.sample_means / static_cast<double>(window.samples));
  expect_value(text, "tally_loss_sum_total" + train, trained.loss);
  EXPECT_EQ(Value(text, "tally_valid_tokens_total" + train), trained.tokens);
  expect_value(text, "tally_loss_sum_total" + eval, evaluated_sums.loss);

  // DeleteModel drops every series of the model, eval ones included.
  ASSERT_TRUE(e.DeleteModel("m").ok());
  m.RemoveModel("m");
  text = Scrape(m.port());
  EXPECT_EQ(text.find("model_id=\"m\""), std::string::npos) << text;
}

// The tally_policy_* families, one per unit: NaN from the model's first
// call until a call carries sampling_logprobs, then that call's PolicyStats
// (eight series per model), kept by calls without them, and dropped with
// the model.
TEST_F(ModelMetricsTest, PolicyStatisticsOfTheLastRlCall) {
  ServerMetrics& m = *metrics_;
  auto call = [&](std::vector<Sample> samples, const char* loss) {
    ForwardBackwardArgs args{std::move(samples)};
    args.loss = ParseLossSpec(loss, {}).value();
    return Call(args);
  };
  const std::string model = "{rank=\"0\",model_id=\"m\"";
  const std::string ratio = "tally_policy_importance_ratio" + model;
  const std::string gap = "tally_policy_logprob_gap_nats" + model;
  const std::string clipped = "tally_policy_clipped_tokens_ratio" + model + "}";
  const std::string kl = "tally_policy_kl_nats{rank=\"0\",estimator=";
  call(MakeSamples(vocab_, {3, 5}, 7), "cross_entropy");
  std::string text = Scrape(m.port());
  EXPECT_TRUE(std::isnan(Value(text, ratio + ",stat=\"mean\"}"))) << text;
  EXPECT_TRUE(std::isnan(Value(text, clipped))) << text;
  EXPECT_TRUE(std::isnan(Value(text, kl + "\"k3\",model_id=\"m\"}"))) << text;

  std::vector<Sample> rl = MakeSamples(vocab_, {4, 6}, 8);
  testing::AddPolicyInputs(rl, -std::log(vocab_), 9);
  const v1::PolicyStats policy = call(rl, "ppo").policy();
  ASSERT_EQ(policy.tokens(), 10);
  call(MakeSamples(vocab_, {2}, 10), "cross_entropy");  // keeps them
  text = Scrape(m.port());
  EXPECT_NEAR(Value(text, ratio + ",stat=\"mean\"}"), policy.ratio_mean(),
              1e-15);
  EXPECT_NEAR(Value(text, ratio + ",stat=\"min\"}"), policy.ratio_min(), 1e-15);
  EXPECT_NEAR(Value(text, ratio + ",stat=\"max\"}"), policy.ratio_max(), 1e-15);
  EXPECT_NEAR(Value(text, clipped), policy.clipped_fraction(), 1e-15);
  EXPECT_GT(policy.clipped_fraction(), 0);
  EXPECT_NEAR(Value(text, gap + ",stat=\"mean\"}"), policy.logprob_gap_mean(),
              1e-15);
  EXPECT_NEAR(Value(text, gap + ",stat=\"max\"}"), policy.logprob_gap_max(),
              1e-15);
  EXPECT_NEAR(Value(text, kl + "\"k1\",model_id=\"m\"}"), policy.kl_k1(),
              1e-15);
  EXPECT_NEAR(Value(text, kl + "\"k3\",model_id=\"m\"}"), policy.kl_k3(),
              1e-15);

  ASSERT_TRUE(engine_->DeleteModel("m").ok());
  m.RemoveModel("m");
  EXPECT_EQ(Scrape(m.port()).find("tally_policy_"), std::string::npos);
}

// The series one model adds to rank 0, as docs/metrics.md counts them: 110
// once it trained and stepped (the grad norm histogram's 36, the execution
// histograms' 2 x 25, 13 gauges and counters, 8 policy statistics, 3 shard
// sizes), 2 more once evaluated, none once a call carries sampling_logprobs,
// 26 once sampled (tally_sample_seconds' 25, tally_sampled_tokens_total),
// 46 more once a decode reported (the time to first token's 25, the token
// time's 19, the KV-cache bytes and active sequences).
TEST_F(ModelMetricsTest, SeriesPerModelAreBoundedAsDocumented) {
  auto count = [&] {
    const std::string text = Scrape(metrics_->port());
    int64_t series = 0;
    for (size_t at = text.find("model_id=\"m\""); at != std::string::npos;
         at = text.find("model_id=\"m\"", at + 1)) {
      ++series;
    }
    return series;
  };
  std::vector<Sample> samples = MakeSamples(vocab_, {3, 5}, 7);
  Call({samples});
  ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
  v1::OptimStepResponse stepped;
  metrics_->RecordOptimStep("m", stepped, 0.5);
  const int64_t trained = count();
  Call({samples, LossReduction::kTokenMean, /*forward_only=*/true});
  const int64_t evaluated = count();
  testing::AddPolicyInputs(samples, -std::log(vocab_), 9);
  ForwardBackwardArgs rl{samples};
  rl.loss = ParseLossSpec("ppo", {}).value();
  Call(rl);
  const int64_t rl_called = count();
  metrics_->RecordSample("m", 7, 0.25);
  const int64_t sampled = count();
  metrics_->RecordSample("m", 3, 0.5);
  const int64_t resampled = count();
  DecodeStats first;
  first.step = 1;
  first.step_seconds = 0.125;
  first.active_sequences = 3;
  first.cache_bytes = 4096;
  metrics_->ObserveDecodeProgress("m", first);
  const int64_t decoding = count();
  std::string text = Scrape(metrics_->port());
  EXPECT_EQ(
      Value(text, "tally_sample_active_sequences{rank=\"0\",model_id=\"m\"}"),
      3);
  EXPECT_EQ(
      Value(text, "tally_sample_kv_cache_bytes{rank=\"0\",model_id=\"m\"}"),
      4096);
  DecodeStats later = first;
  later.step = 2;
  later.step_seconds = 0.002;
  metrics_->ObserveDecodeProgress("m", later);
  metrics_->ObserveDecodeProgress("m", later);
  DecodeStats done;
  done.done = true;
  done.step_seconds = 0.001;
  metrics_->ObserveDecodeProgress("m", done);
  EXPECT_EQ(trained, 110);
  EXPECT_EQ(evaluated - trained, 2);
  EXPECT_EQ(rl_called - evaluated, 0);
  EXPECT_EQ(sampled - rl_called, 26);
  EXPECT_EQ(resampled - sampled, 0);
  EXPECT_EQ(decoding - resampled, 46);
  EXPECT_EQ(count() - decoding, 0);
  text = Scrape(metrics_->port());
  EXPECT_EQ(
      Value(text, "tally_sampled_tokens_total{rank=\"0\",model_id=\"m\"}"), 10);
  EXPECT_EQ(
      Value(text, "tally_sample_seconds_count{rank=\"0\",model_id=\"m\"}"), 2);
  // The first token once, the later steps each; the gauges back at 0.
  EXPECT_EQ(Value(text,
                  "tally_sample_time_to_first_token_seconds_count{rank=\"0\","
                  "model_id=\"m\"}"),
            1);
  EXPECT_EQ(Value(text,
                  "tally_sample_time_to_first_token_seconds_sum{rank=\"0\","
                  "model_id=\"m\"}"),
            0.125);
  EXPECT_EQ(
      Value(text,
            "tally_sample_token_seconds_count{rank=\"0\",model_id=\"m\"}"),
      2);
  EXPECT_EQ(
      Value(text, "tally_sample_active_sequences{rank=\"0\",model_id=\"m\"}"),
      0);
  EXPECT_EQ(
      Value(text, "tally_sample_kv_cache_bytes{rank=\"0\",model_id=\"m\"}"), 0);
  // Deleting the model drops its sampling series with the others.
  ASSERT_TRUE(engine_->DeleteModel("m").ok());
  metrics_->RemoveModel("m");
  EXPECT_EQ(count(), 0);
}

// The largest finite buckets docs/metrics.md states: ForwardBackward and
// OptimStep 1 ms .. 2097.152 s (~35 min, 22 buckets), checkpoints 1 ms ..
// 16777.216 s (~4.7 h, 25 buckets), seq_id gap waits 1 ms ..
// 4194.304 s (past the longest gap timeout, 3600 s).
TEST(ServerMetricsTest, LatencyBucketsReachMinutesAndHours) {
  auto engine = Engine::CreateSingleRank({});
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto metrics = ServerMetrics::Create("127.0.0.1:0", engine->get());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  ServerMetrics& m = **metrics;
  ASSERT_TRUE(
      (*engine)
          ->CreateModel(TinySpec("m", DType::kFloat32, OptimizerKind::kAdamW))
          .ok());
  m.ObserveForwardBackwardSeconds("m", 20 * 60.0);
  m.ObserveOptimStepSeconds("m", 0.002);
  m.RecordCheckpoint("save", /*ok=*/true, 3 * 3600.0);
  m.RecordSeqGapWait(1.0);
  const std::string text = Scrape(m.port());

  const std::string model = "{rank=\"0\",model_id=\"m\",";
  for (const char* name :
       {"tally_forward_backward_seconds", "tally_optim_step_seconds"}) {
    SCOPED_TRACE(name);
    const std::vector<double> bounds =
        FiniteBounds(text, absl::StrCat(name, "_bucket", model));
    ASSERT_EQ(bounds.size(), 22u);
    EXPECT_EQ(bounds.front(), 0.001);
    EXPECT_DOUBLE_EQ(bounds.back(), 2097.152);
    for (size_t i = 1; i < bounds.size(); ++i) {
      EXPECT_DOUBLE_EQ(bounds[i], 2 * bounds[i - 1]);
    }
  }
  // A 20-minute call lands in a finite bucket.
  EXPECT_EQ(Value(text,
                  "tally_forward_backward_seconds_bucket{rank=\"0\",model_id="
                  "\"m\",le=\"1048.576\"}"),
            0);
  EXPECT_EQ(Value(text,
                  "tally_forward_backward_seconds_bucket{rank=\"0\",model_id="
                  "\"m\",le=\"2097.152\"}"),
            1);

  const std::vector<double> checkpoint = FiniteBounds(
      text, "tally_checkpoint_seconds_bucket{rank=\"0\",kind=\"save\",");
  ASSERT_EQ(checkpoint.size(), 25u);
  EXPECT_EQ(checkpoint.front(), 0.001);
  EXPECT_DOUBLE_EQ(checkpoint.back(), 16777.216);
  // A 3-hour save too.
  EXPECT_EQ(Value(text,
                  "tally_checkpoint_seconds_bucket{rank=\"0\",kind=\"save\","
                  "le=\"8388.608\"}"),
            0);
  EXPECT_EQ(Value(text,
                  "tally_checkpoint_seconds_bucket{rank=\"0\",kind=\"save\","
                  "le=\"16777.216\"}"),
            1);

  const std::vector<double> gap =
      FiniteBounds(text, "tally_seq_gap_wait_seconds_bucket{rank=\"0\",");
  ASSERT_EQ(gap.size(), 23u);
  EXPECT_DOUBLE_EQ(gap.back(), 4194.304);
  EXPECT_GT(gap.back(), 3600);  // the longest --seq-gap-timeout-secs
}

}  // namespace
}  // namespace tally
