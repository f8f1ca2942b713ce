// End-to-end test of stopping a running Sample on a 2-rank tally-server: a
// Sample cancelled by its client while it decodes stops on every rank (the
// server answers it CANCELLED rather than finishing it), as does one whose
// deadline passes (DEADLINE_EXCEEDED), and the server goes on serving: a
// Sample, a ForwardBackward and an OptimStep of the same model afterwards
// answer exactly what they answer on an identical model that never saw the
// cancelled call. Run on a lockstep mesh (dp_shard: the data ranks' forwards
// meet in ZeRO gathers) and a tensor-parallel one (no data split; the ranks
// meet only in the stop checks and tp's collectives).
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/trainer_client.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/server_process.h"

namespace tally {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::tally::testing::HttpGet;
using ::tally::testing::MetricValue;
using ::tally::testing::ServerProcess;
using ::tally::testing::TinyModelConfig;

constexpr int32_t kVocab = ::tally::testing::kTinyVocab;
constexpr absl::Duration kShutdownTimeout = absl::Seconds(30);
// Far more steps than the test waits for: a stop ends it.
constexpr int32_t kEndlessTokens = 50000;

v1::CreateModelRequest TinyModel(const std::string& model_id) {
  v1::CreateModelRequest request;
  request.set_model_id(model_id);
  *request.mutable_config() = TinyModelConfig();
  request.set_seed(7);
  request.set_dtype(v1::DTYPE_FLOAT32);
  request.set_optimizer(v1::OPTIMIZER_ADAMW);
  return request;
}

void AddPrompt(v1::TokenSequence* prompt, const std::vector<int32_t>& tokens) {
  prompt->mutable_tokens()->Add(tokens.begin(), tokens.end());
}

// Two prompts x 2 samples, no stop condition (params.stop empty).
v1::SampleRequest SampleOf(const std::string& model_id, int32_t max_tokens,
                           uint64_t seed) {
  v1::SampleRequest request;
  request.set_model_id(model_id);
  AddPrompt(request.add_prompts(), {3, 14, 15});
  AddPrompt(request.add_prompts(), {9, 2});
  request.set_num_samples(2);
  request.mutable_params()->set_max_tokens(max_tokens);
  request.mutable_params()->set_temperature(1.0);
  request.mutable_params()->set_seed(seed);
  request.mutable_params()->mutable_stop();
  return request;
}

v1::ForwardBackwardRequest TrainingCall(const std::string& model_id) {
  std::mt19937 rng(11);
  v1::ForwardBackwardRequest request;
  request.set_model_id(model_id);
  for (int length : {9, 5, 12}) {
    *request.add_samples() = testing::MakeSample(rng, kVocab, length, 1);
  }
  return request;
}

// What a model answers after the call under test: a Sample, a training step
// and a Sample of the stepped weights.
struct Answers {
  v1::SampleResponse before;
  v1::ForwardBackwardResponse forward_backward;
  v1::OptimStepResponse step;
  v1::SampleResponse after;
};

Answers RunAfter(TrainerClient& client, const std::string& model_id) {
  Answers answers;
  absl::StatusOr<v1::SampleResponse> sample =
      client.Sample(SampleOf(model_id, 6, 5));
  EXPECT_TRUE(sample.ok()) << sample.status();
  answers.before = sample.value_or(v1::SampleResponse());
  absl::StatusOr<v1::ForwardBackwardResponse> forward_backward =
      client.ForwardBackward(TrainingCall(model_id));
  EXPECT_TRUE(forward_backward.ok()) << forward_backward.status();
  answers.forward_backward =
      forward_backward.value_or(v1::ForwardBackwardResponse());
  // The engine's metrics carry its timings.
  answers.forward_backward.clear_metrics();
  v1::OptimStepRequest step;
  step.set_model_id(model_id);
  step.mutable_adam()->set_learning_rate(1e-2);
  absl::StatusOr<v1::OptimStepResponse> stepped = client.OptimStep(step);
  EXPECT_TRUE(stepped.ok()) << stepped.status();
  answers.step = stepped.value_or(v1::OptimStepResponse());
  answers.step.clear_metrics();
  sample = client.Sample(SampleOf(model_id, 6, 5));
  EXPECT_TRUE(sample.ok()) << sample.status();
  answers.after = sample.value_or(v1::SampleResponse());
  return answers;
}

// The value of `name`{model_id=`model_id`} on the server's /metrics, or an
// error while it has none.
absl::StatusOr<double> ModelMetric(const ServerProcess& server,
                                   const std::string& name,
                                   const std::string& model_id) {
  const absl::StatusOr<std::string> metrics =
      HttpGet(server.metrics_port(), "/metrics");
  if (!metrics.ok()) return metrics.status();
  return MetricValue(*metrics, name, {{"model_id", model_id}});
}

// How many Samples the server answered with `code`.
absl::StatusOr<double> SamplesAnswered(const ServerProcess& server,
                                       const std::string& code) {
  const absl::StatusOr<std::string> metrics =
      HttpGet(server.metrics_port(), "/metrics");
  if (!metrics.ok()) return metrics.status();
  return MetricValue(*metrics, "tally_requests_total",
                     {{"method", "Sample"}, {"code", code}});
}

class SampleCancelE2eTest
    : public ::testing::TestWithParam<std::vector<std::string>> {
 protected:
  void TearDown() override {
    client_.reset();
    testing::ExpectCleanShutdown(servers_, kShutdownTimeout);
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::unique_ptr<TrainerClient> client_;
};

TEST_P(SampleCancelE2eTest, ACancelledSampleStopsOnEveryRankAndChangesNothing) {
  ServerProcess* server = testing::StartServerOrFail(GetParam(), servers_);
  ASSERT_NE(server, nullptr);
  TrainerClientOptions options;
  options.target = server->grpc_target();
  options.deadline = absl::Seconds(120);
  options.retry.max_attempts = 1;
  client_ = std::make_unique<TrainerClient>(options);
  ASSERT_TRUE(client_->WaitForServing(absl::Seconds(30)).ok())
      << server->ReadLog();
  ASSERT_TRUE(client_->CreateModel(TinyModel("a")).ok());
  ASSERT_TRUE(client_->CreateModel(TinyModel("b")).ok());

  // A Sample of "a" that would decode for hours, cancelled once rank 0
  // reports it decoding.
  auto stub = v1::Trainer::NewStub(TrainerClient::MakeChannel(options));
  grpc::ClientContext context;
  grpc::Status cancelled_status;
  std::thread caller([&] {
    v1::SampleResponse response;
    cancelled_status =
        stub->Sample(&context, SampleOf("a", kEndlessTokens, 17), &response);
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(120);
  while (
      ModelMetric(*server, "tally_sample_active_sequences", "a").value_or(0) <=
          0 &&
      absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));  // polling the condition
  }
  context.TryCancel();
  caller.join();
  EXPECT_EQ(cancelled_status.error_code(), grpc::StatusCode::CANCELLED)
      << cancelled_status.error_message();

  // One whose deadline passes while it decodes (on a host too slow to
  // start it within the deadline, before it runs): DEADLINE_EXCEEDED.
  {
    grpc::ClientContext expiring;
    expiring.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
    v1::SampleResponse response;
    const grpc::Status expired =
        stub->Sample(&expiring, SampleOf("a", kEndlessTokens, 19), &response);
    EXPECT_EQ(expired.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << expired.error_message();
  }

  // Queued behind the cancelled call: they run once it stopped.
  const Answers a = RunAfter(*client_, "a");
  const Answers b = RunAfter(*client_, "b");
  EXPECT_TRUE(MessageDifferencer::Equals(a.before, b.before));
  EXPECT_TRUE(
      MessageDifferencer::Equals(a.forward_backward, b.forward_backward));
  EXPECT_TRUE(MessageDifferencer::Equals(a.step, b.step));
  EXPECT_TRUE(MessageDifferencer::Equals(a.after, b.after));
  EXPECT_EQ(a.before.sequences_size(), 4);
  EXPECT_EQ(a.before.step(), 0);
  EXPECT_EQ(a.after.step(), 1);
  EXPECT_GT(a.forward_backward.valid_tokens(), 0);

  // The server answered both calls as given up: it stopped decoding,
  // rather than finishing kEndlessTokens and answering OK; nothing is left
  // running. (gRPC cancels a call whose deadline passed, so the server may
  // see the cancellation a moment before its clock passes the deadline and
  // answer CANCELLED; the client gets DEADLINE_EXCEEDED either way.)
  EXPECT_EQ(SamplesAnswered(*server, "CANCELLED").value_or(0) +
                SamplesAnswered(*server, "DEADLINE_EXCEEDED").value_or(0),
            2.0)
      << server->ReadLog();
  EXPECT_EQ(SamplesAnswered(*server, "OK").value_or(-1), 4.0);
  EXPECT_EQ(
      ModelMetric(*server, "tally_sample_active_sequences", "a").value_or(-1),
      0.0);
  EXPECT_EQ(
      ModelMetric(*server, "tally_sample_kv_cache_bytes", "a").value_or(-1),
      0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, SampleCancelE2eTest,
    ::testing::Values(
        std::vector<std::string>{"--nproc-per-node", "2", "--dp-shard", "2"},
        std::vector<std::string>{"--nproc-per-node", "2", "--tp", "2"}));

}  // namespace
}  // namespace tally
