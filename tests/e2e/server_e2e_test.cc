// End-to-end test of tally-server: launches the real binary ($TALLY_SERVER),
// drives it over gRPC with the C++ client, reads its Prometheus metrics over
// plain HTTP, and checks every answer against values computed here from the
// requests themselves.
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/client_context.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "client/trainer_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/server_process.h"

namespace tally {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::tally::testing::CheckHealth;
using ::tally::testing::HttpGet;
using ::tally::testing::kIgnoredTarget;
using ::tally::testing::MakeSample;
using ::tally::testing::MetricValue;
using ::tally::testing::ServerBinaryFromEnv;
using ::tally::testing::ServerProcess;
using ::tally::testing::ValidTokens;
using ::testing::HasSubstr;

// The tiny FLOAT64 Llama every test trains.
constexpr int32_t kVocab = testing::kTinyVocab;
constexpr int32_t kHidden = testing::kTinyHidden;
constexpr int32_t kIntermediate = testing::kTinyIntermediate;
constexpr int32_t kLayers = testing::kTinyLayers;
constexpr int32_t kHeads = testing::kTinyHeads;
constexpr int32_t kKvHeads = testing::kTinyKvHeads;
constexpr int32_t kMaxPositions = testing::kTinyMaxPositions;
constexpr double kMaxGradNorm = 1.0;

constexpr int kCallsPerStep = 3;
constexpr absl::Duration kShutdownTimeout = absl::Seconds(30);

v1::CreateModelRequest TinyModelRequest(const std::string& model_id,
                                        uint64_t seed) {
  v1::CreateModelRequest request;
  request.set_model_id(model_id);
  *request.mutable_config() = testing::TinyModelConfig();
  request.set_seed(seed);
  request.set_dtype(v1::DTYPE_FLOAT64);
  request.set_default_max_grad_norm(kMaxGradNorm);
  return request;
}

// Counted from the Llama architecture, not asked of the server: embeddings,
// per layer q/k/v/o + gate/up/down + two RMSNorms, the final norm, lm_head.
uint64_t TinyParameterCount() {
  const uint64_t head_dim = kHidden / kHeads;
  const uint64_t attention = kHidden * kHidden                    // q_proj
                             + 2 * kHidden * kKvHeads * head_dim  // k, v
                             + kHidden * kHidden;                 // o_proj
  const uint64_t mlp = 3 * uint64_t{kHidden} * kIntermediate;
  const uint64_t layer_norms = 2 * kHidden;
  return uint64_t{kVocab} * kHidden +
         kLayers * (attention + mlp + layer_norms) + kHidden +
         uint64_t{kVocab} * kHidden;
}

// Weights for MakeSample: 0 at every `zero_every`-th position, the others in
// {0.5, 0.75, 1}; no weights when `zero_every` is 0.
std::function<float(int)> ZeroWeightEvery(int zero_every) {
  if (zero_every == 0) return {};
  return [zero_every](int i) {
    return i % zero_every == 0 ? 0.0f : 0.5f + 0.25f * (i % 3);
  };
}

struct ValidCounts {
  int64_t tokens = 0;
  int64_t samples = 0;  // samples with at least one valid token
};

ValidCounts CountValid(const std::vector<v1::Sample>& samples) {
  ValidCounts counts;
  for (const v1::Sample& sample : samples) {
    const int64_t valid = ValidTokens(sample);
    counts.tokens += valid;
    if (valid > 0) ++counts.samples;
  }
  return counts;
}

// The samples of call `call` of training step `step`: 1 to 4 samples (never
// the same count twice in a step) of 5 to 44 tokens with masked prompts, every
// other sample carrying zero weights.
std::vector<v1::Sample> TrainingCall(int step, int call) {
  std::mt19937 rng(7919 * step + call);
  const int count = 1 + (step + call) % 4;
  std::vector<v1::Sample> samples;
  for (int i = 0; i < count; ++i) {
    const int length = 5 + static_cast<int>(rng() % 40);
    const int masked = static_cast<int>(rng() % (length / 2));
    samples.push_back(MakeSample(rng, kVocab, length, masked,
                                 ZeroWeightEvery(i % 2 == 1 ? 3 : 0)));
  }
  return samples;
}

// Two fixed samples whose forward-only loss fingerprints the weights.
std::vector<v1::Sample> ProbeSamples() {
  std::mt19937 rng(42);
  return {MakeSample(rng, kVocab, 20, 3), MakeSample(rng, kVocab, 33, 0)};
}

v1::ForwardBackwardRequest ForwardBackwardRequest(
    const std::string& model_id, const std::vector<v1::Sample>& samples) {
  v1::ForwardBackwardRequest request;
  request.set_model_id(model_id);
  for (const v1::Sample& sample : samples) *request.add_samples() = sample;
  return request;
}

v1::OptimStepRequest OptimStepRequest(const std::string& model_id) {
  v1::OptimStepRequest request;
  request.set_model_id(model_id);
  return request;
}

absl::StatusOr<double> ProbeLoss(TrainerClient& client,
                                 const std::string& model_id) {
  v1::ForwardBackwardRequest request =
      ForwardBackwardRequest(model_id, ProbeSamples());
  request.set_forward_only(true);
  TALLY_ASSIGN_OR_RETURN(v1::ForwardBackwardResponse response,
                         client.ForwardBackward(request));
  return response.loss_sum();
}

// Sends the calls of training step `step`, then steps the optimizer.
absl::StatusOr<v1::OptimStepResponse> TrainStep(TrainerClient& client,
                                                const std::string& model_id,
                                                int step) {
  for (int call = 0; call < kCallsPerStep; ++call) {
    TALLY_RETURN_IF_ERROR(client
                              .ForwardBackward(ForwardBackwardRequest(
                                  model_id, TrainingCall(step, call)))
                              .status());
  }
  return client.OptimStep(OptimStepRequest(model_id));
}

// Everything a rejected request must leave as it was.
struct ModelState {
  int64_t step = 0;
  int64_t calls = 0;
  int64_t tokens = 0;
  int64_t samples = 0;
  v1::LossReduction pending_reduction = v1::LOSS_REDUCTION_UNSPECIFIED;
  double probe_loss = 0;
  int num_models = 0;
};

absl::StatusOr<ModelState> Observe(TrainerClient& client,
                                   const std::string& model_id) {
  v1::GetModelRequest get;
  get.set_model_id(model_id);
  TALLY_ASSIGN_OR_RETURN(v1::ModelInfo info, client.GetModel(get));
  TALLY_ASSIGN_OR_RETURN(v1::ListModelsResponse all,
                         client.ListModels(v1::ListModelsRequest()));
  ModelState state;
  state.step = info.step();
  state.calls = info.accumulated_calls();
  state.tokens = info.accumulated_tokens();
  state.samples = info.accumulated_samples();
  state.pending_reduction = info.pending_reduction();
  TALLY_ASSIGN_OR_RETURN(state.probe_loss, ProbeLoss(client, model_id));
  state.num_models = all.models_size();
  return state;
}

void ExpectUnchanged(const ModelState& before, const ModelState& after) {
  EXPECT_EQ(after.step, before.step);
  EXPECT_EQ(after.calls, before.calls);
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_EQ(after.samples, before.samples);
  EXPECT_EQ(after.pending_reduction, before.pending_reduction);
  // Same weights give the same fp64 forward pass, bit for bit.
  EXPECT_EQ(after.probe_loss, before.probe_loss);
  EXPECT_EQ(after.num_models, before.num_models);
}

// A request that must fail with `code`, naming every one of `message_parts`.
struct Rejection {
  std::string what;
  std::string method;  // the RPC, for tally_requests_total
  std::function<absl::Status()> send;
  absl::StatusCode code;
  std::vector<std::string> message_parts;
};

// One tally-server per test, stopped with SIGTERM in TearDown, which also
// asserts that every server the test started exits 0 within 30 s.
class ServerE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartServer({});
    ASSERT_NE(server_, nullptr);
    client_ = Connect(*server_);
    const absl::Status serving = client_->WaitForServing(absl::Seconds(30));
    ASSERT_TRUE(serving.ok()) << serving;
  }

  void TearDown() override {
    // An idle connected client stretches gRPC's graceful shutdown by ~5 s
    // (covered once, by SigtermWithAnIdleClientConnectedExitsZero); closing it
    // first keeps the suite fast.
    client_.reset();
    testing::ExpectCleanShutdown(servers_, kShutdownTimeout);
  }

  // nullptr, with the failure recorded, when the server does not come up.
  ServerProcess* StartServer(const std::vector<std::string>& args) {
    return testing::StartServerOrFail(args, servers_);
  }

  static std::unique_ptr<TrainerClient> Connect(const ServerProcess& server) {
    TrainerClientOptions options;
    options.target = server.grpc_target();
    options.deadline = absl::Seconds(60);
    return std::make_unique<TrainerClient>(options);
  }

  void ExpectServing(const ServerProcess& server) {
    absl::StatusOr<HealthCheckResponse::ServingStatus> health =
        CheckHealth(server.grpc_target());
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(*health, HealthCheckResponse::SERVING);
  }

  // The tiny model `model_id` one step into training, with one TOKEN_MEAN call
  // pending, so a rejected request has a step, a window and weights to spoil.
  void CreateTrainedModelWithPendingCall(const std::string& model_id) {
    const absl::Status created =
        client_->CreateModel(TinyModelRequest(model_id, 3)).status();
    ASSERT_TRUE(created.ok()) << created;
    TALLY_ASSERT_OK_AND_ASSIGN(v1::OptimStepResponse stepped,
                               TrainStep(*client_, model_id, 0));
    ASSERT_EQ(stepped.step(), 1);
    TALLY_ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse pending,
                               client_->ForwardBackward(ForwardBackwardRequest(
                                   model_id, TrainingCall(5, 0))));
    ASSERT_EQ(pending.accumulated_calls(), 1);
  }

  // Sends each rejection and checks its code and message, that `model_id` is
  // unchanged and the server still SERVING after it, and finally that
  // tally_requests_total counted every rejection under its method and code.
  void ExpectRejectedWithoutEffect(const std::string& model_id,
                                   const std::vector<Rejection>& rejections) {
    TALLY_ASSERT_OK_AND_ASSIGN(const ModelState before,
                               Observe(*client_, model_id));
    std::map<std::pair<std::string, std::string>, int> expected_counts;
    for (const Rejection& rejection : rejections) {
      SCOPED_TRACE(rejection.what);
      const absl::Status status = rejection.send();
      EXPECT_EQ(status.code(), rejection.code) << status;
      for (const std::string& part : rejection.message_parts) {
        EXPECT_THAT(std::string(status.message()), HasSubstr(part));
      }
      ++expected_counts[{rejection.method,
                         absl::StatusCodeToString(rejection.code)}];
      TALLY_ASSERT_OK_AND_ASSIGN(const ModelState after,
                                 Observe(*client_, model_id));
      ExpectUnchanged(before, after);
      ExpectServing(*server_);
    }
    TALLY_ASSERT_OK_AND_ASSIGN(const std::string metrics,
                               HttpGet(server_->metrics_port(), "/metrics"));
    for (const auto& [method_code, count] : expected_counts) {
      SCOPED_TRACE(absl::StrCat(method_code.first, " ", method_code.second));
      absl::StatusOr<double> counted = MetricValue(
          metrics, "tally_requests_total",
          {{"method", method_code.first}, {"code", method_code.second}});
      ASSERT_TRUE(counted.ok()) << counted.status();
      EXPECT_EQ(*counted, count);
    }
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  ServerProcess* server_ = nullptr;
  std::unique_ptr<TrainerClient> client_;
};

TEST_F(ServerE2eTest, ServesHealthAndCreatesTheRequestedModel) {
  ExpectServing(*server_);

  TALLY_ASSERT_OK_AND_ASSIGN(v1::ModelInfo created,
                             client_->CreateModel(TinyModelRequest("tiny", 1)));
  EXPECT_EQ(created.model_id(), "tiny");
  EXPECT_EQ(TinyParameterCount(), 19616u);  // the sum above, done by hand
  EXPECT_EQ(created.num_parameters(), TinyParameterCount());
  EXPECT_EQ(created.config().vocab_size(), kVocab);
  EXPECT_EQ(created.config().hidden_size(), kHidden);
  EXPECT_EQ(created.config().intermediate_size(), kIntermediate);
  EXPECT_EQ(created.config().num_hidden_layers(), kLayers);
  EXPECT_EQ(created.config().num_attention_heads(), kHeads);
  EXPECT_EQ(created.config().num_key_value_heads(), kKvHeads);
  EXPECT_EQ(created.config().max_position_embeddings(), kMaxPositions);
  // Fields left at 0 take the HF defaults the proto documents.
  EXPECT_EQ(created.config().rms_norm_eps(), 1e-6);
  EXPECT_EQ(created.config().rope_theta(), 10000.0);
  EXPECT_FALSE(created.config().tie_word_embeddings());
  EXPECT_EQ(created.step(), 0);
  EXPECT_EQ(created.accumulated_calls(), 0);
  EXPECT_EQ(created.accumulated_tokens(), 0);
  EXPECT_EQ(created.accumulated_samples(), 0);
  EXPECT_EQ(created.pending_reduction(), v1::LOSS_REDUCTION_UNSPECIFIED);
  EXPECT_EQ(created.dtype(), v1::DTYPE_FLOAT64);
  EXPECT_EQ(created.optimizer(), v1::OPTIMIZER_ADAMW);
  EXPECT_EQ(created.default_adam().learning_rate(), 1e-3);
  EXPECT_EQ(created.default_adam().beta1(), 0.9);
  EXPECT_EQ(created.default_adam().beta2(), 0.999);
  EXPECT_EQ(created.default_adam().eps(), 1e-8);
  EXPECT_EQ(created.default_adam().weight_decay(), 0.01);
  EXPECT_EQ(created.default_max_grad_norm(), kMaxGradNorm);

  v1::GetModelRequest get;
  get.set_model_id("tiny");
  TALLY_ASSERT_OK_AND_ASSIGN(v1::ModelInfo fetched, client_->GetModel(get));
  EXPECT_TRUE(MessageDifferencer::Equals(fetched, created))
      << fetched.DebugString() << " vs " << created.DebugString();
  TALLY_ASSERT_OK_AND_ASSIGN(v1::ListModelsResponse listed,
                             client_->ListModels(v1::ListModelsRequest()));
  ASSERT_EQ(listed.models_size(), 1);
  EXPECT_TRUE(MessageDifferencer::Equals(listed.models(0), created));
}

// The server computes with a tuned BLAS (scripts/install-deps.sh installs
// BLIS), says so on /metrics, and runs with OpenMP's passive wait policy
// (server/main.cc executes itself again with it when the environment did not
// choose one).
TEST_F(ServerE2eTest, ComputesWithATunedBlasAndPassiveOpenMpThreads) {
  TALLY_ASSERT_OK_AND_ASSIGN(const std::string metrics,
                             HttpGet(server_->metrics_port(), "/metrics"));
  int tuned = 0;
  for (const char* blas : {"blis", "openblas", "mkl"}) {
    tuned += MetricValue(metrics, "tally_build_info",
                         {{"blas", blas}, {"onednn", "true"}})
                 .ok();
  }
  EXPECT_EQ(tuned, 1) << metrics;
  TALLY_ASSERT_OK_AND_ASSIGN(const double threads,
                             MetricValue(metrics, "tally_compute_threads", {}));
  EXPECT_GE(threads, 1);

  if (std::getenv("OMP_WAIT_POLICY") != nullptr) {
    GTEST_SKIP() << "this test's environment sets OMP_WAIT_POLICY";
  }
  std::ifstream environ_file(
      absl::StrCat("/proc/", server_->pid(), "/environ"));
  const std::string environ((std::istreambuf_iterator<char>(environ_file)),
                            std::istreambuf_iterator<char>());
  const std::vector<std::string> variables = absl::StrSplit(environ, '\0');
  EXPECT_THAT(variables, ::testing::Contains("OMP_WAIT_POLICY=PASSIVE"));
}

// ListModels pages through the models in id order: every model exactly once,
// the last page without a token; a bad page_size or page_token names the
// field.
TEST_F(ServerE2eTest, ListModelsPagesInModelIdOrder) {
  const std::vector<std::string> ids = {"m-c", "m-a", "m-e", "m-b", "m-d"};
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(client_->CreateModel(TinyModelRequest(ids[i], i + 1)).ok());
  }
  std::vector<std::string> seen;
  int pages = 0;
  v1::ListModelsRequest request;
  request.set_page_size(2);
  do {
    TALLY_ASSERT_OK_AND_ASSIGN(v1::ListModelsResponse page,
                               client_->ListModels(request));
    EXPECT_LE(page.models_size(), 2);
    for (const v1::ModelInfo& model : page.models()) {
      seen.push_back(model.model_id());
    }
    request.set_page_token(page.next_page_token());
    ASSERT_LT(++pages, 10) << "the pages never end";
  } while (!request.page_token().empty());
  EXPECT_EQ(pages, 3);
  std::vector<std::string> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(seen, sorted);
  TALLY_ASSERT_OK_AND_ASSIGN(v1::ListModelsResponse all,
                             client_->ListAllModels());
  EXPECT_EQ(all.models_size(), static_cast<int>(ids.size()));
  EXPECT_TRUE(all.next_page_token().empty());

  v1::ListModelsRequest negative;
  negative.set_page_size(-1);
  const absl::Status refused = client_->ListModels(negative).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("page_size"));
  v1::ListModelsRequest forged;
  forged.set_page_token("not-a-token");
  const absl::Status bad_token = client_->ListModels(forged).status();
  EXPECT_EQ(bad_token.code(), absl::StatusCode::kInvalidArgument) << bad_token;
  EXPECT_THAT(std::string(bad_token.message()), HasSubstr("page_token"));
}

TEST_F(ServerE2eTest, AccumulatesUnevenCallsStepsAndExportsMetrics) {
  const std::string id = "tiny";
  ASSERT_TRUE(client_->CreateModel(TinyModelRequest(id, 1)).ok());
  v1::GetModelRequest get;
  get.set_model_id(id);

  v1::OptimStepResponse last_step;
  ValidCounts trained;
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    ValidCounts window;
    for (int call = 0; call < kCallsPerStep; ++call) {
      SCOPED_TRACE(absl::StrCat("call ", call));
      const std::vector<v1::Sample> samples = TrainingCall(step, call);
      const ValidCounts expected = CountValid(samples);
      ASSERT_GT(expected.tokens, 0);
      TALLY_ASSERT_OK_AND_ASSIGN(
          v1::ForwardBackwardResponse out,
          client_->ForwardBackward(ForwardBackwardRequest(id, samples)));
      EXPECT_EQ(out.valid_tokens(), expected.tokens);
      EXPECT_EQ(out.num_samples(), expected.samples);
      ASSERT_EQ(out.samples_size(), static_cast<int>(samples.size()));
      double loss_sum = 0;
      for (size_t i = 0; i < samples.size(); ++i) {
        EXPECT_EQ(out.samples(i).valid_tokens(), ValidTokens(samples[i]));
        // Cross-entropy is > 0 exactly where some token counts.
        EXPECT_EQ(out.samples(i).loss_sum() > 0, ValidTokens(samples[i]) > 0);
        loss_sum += out.samples(i).loss_sum();
      }
      EXPECT_NEAR(out.loss_sum(), loss_sum, 1e-9 * loss_sum);
      EXPECT_NEAR(out.loss_mean(), loss_sum / expected.tokens,
                  1e-9 * out.loss_mean());

      window.tokens += out.valid_tokens();
      window.samples += out.num_samples();
      EXPECT_EQ(out.accumulated_calls(), call + 1);
      EXPECT_EQ(out.accumulated_tokens(), window.tokens);
      EXPECT_EQ(out.accumulated_samples(), window.samples);
      TALLY_ASSERT_OK_AND_ASSIGN(v1::ModelInfo info, client_->GetModel(get));
      EXPECT_EQ(info.accumulated_calls(), call + 1);
      EXPECT_EQ(info.accumulated_tokens(), window.tokens);
      EXPECT_EQ(info.accumulated_samples(), window.samples);
      EXPECT_EQ(info.pending_reduction(), v1::LOSS_REDUCTION_TOKEN_MEAN);
      EXPECT_EQ(info.step(), step);
    }

    TALLY_ASSERT_OK_AND_ASSIGN(last_step,
                               client_->OptimStep(OptimStepRequest(id)));
    EXPECT_EQ(last_step.step(), step + 1);
    EXPECT_FALSE(last_step.skipped());
    EXPECT_EQ(last_step.normalizer(), static_cast<double>(window.tokens));
    EXPECT_TRUE(std::isfinite(last_step.grad_norm()));
    EXPECT_GT(last_step.grad_norm(), 0);
    EXPECT_GT(last_step.clip_coef(), 0);
    EXPECT_LE(last_step.clip_coef(), 1);
    // torch.nn.utils.clip_grad_norm_'s coefficient for max norm 1.
    EXPECT_NEAR(last_step.clip_coef(),
                std::min(1.0, kMaxGradNorm / (last_step.grad_norm() + 1e-6)),
                1e-12);
    EXPECT_EQ(last_step.learning_rate(), 1e-3);

    TALLY_ASSERT_OK_AND_ASSIGN(v1::ModelInfo info, client_->GetModel(get));
    EXPECT_EQ(info.step(), step + 1);
    EXPECT_EQ(info.accumulated_calls(), 0);
    EXPECT_EQ(info.accumulated_tokens(), 0);
    EXPECT_EQ(info.accumulated_samples(), 0);
    EXPECT_EQ(info.pending_reduction(), v1::LOSS_REDUCTION_UNSPECIFIED);
    trained.tokens += window.tokens;
    trained.samples += window.samples;
  }

  TALLY_ASSERT_OK_AND_ASSIGN(const std::string metrics,
                             HttpGet(server_->metrics_port(), "/metrics"));
  auto metric = [&](const std::string& name,
                    const std::map<std::string, std::string>& labels) {
    absl::StatusOr<double> value = MetricValue(metrics, name, labels);
    EXPECT_TRUE(value.ok()) << value.status() << "\n" << metrics;
    return value.value_or(std::numeric_limits<double>::quiet_NaN());
  };
  const double grad_norm = metric("tally_grad_norm", {{"model_id", id}});
  // prometheus-cpp prints 16 significant digits: a relative error <= 5e-16.
  EXPECT_NEAR(grad_norm, last_step.grad_norm(), 1e-15 * last_step.grad_norm());
  const double clip = metric("tally_clip_coefficient", {{"model_id", id}});
  EXPECT_NEAR(clip, last_step.clip_coef(), 1e-15 * last_step.clip_coef());
  EXPECT_EQ(metric("tally_optim_steps_total",
                   {{"model_id", id}, {"outcome", "applied"}}),
            3);
  EXPECT_EQ(metric("tally_optim_steps_total",
                   {{"model_id", id}, {"outcome", "skipped_nonfinite"}}),
            0);
  EXPECT_EQ(metric("tally_requests_total",
                   {{"method", "ForwardBackward"}, {"code", "OK"}}),
            3 * kCallsPerStep);
  EXPECT_EQ(
      metric("tally_requests_total", {{"method", "OptimStep"}, {"code", "OK"}}),
      3);
  EXPECT_EQ(metric("tally_valid_tokens_total", {{"model_id", id}}),
            trained.tokens);
  EXPECT_EQ(metric("tally_samples_total", {{"model_id", id}}), trained.samples);
  EXPECT_EQ(metric("tally_pending_tokens", {{"model_id", id}}), 0);
  EXPECT_EQ(metric("tally_model_step", {{"model_id", id}}), 3);
  EXPECT_EQ(metric("tally_models", {}), 1);
}

TEST_F(ServerE2eTest, CheckpointRestoresWeightsOptimizerAndStep) {
  const std::string id = "tiny";
  ASSERT_TRUE(client_->CreateModel(TinyModelRequest(id, 1)).ok());
  for (int step = 0; step < 3; ++step) {
    TALLY_ASSERT_OK_AND_ASSIGN(v1::OptimStepResponse stepped,
                               TrainStep(*client_, id, step));
    ASSERT_EQ(stepped.step(), step + 1);
  }
  TALLY_ASSERT_OK_AND_ASSIGN(const double loss_at_3, ProbeLoss(*client_, id));

  const std::string dir = server_->scratch_dir() + "/checkpoint-3";
  v1::SaveCheckpointRequest save;
  save.set_model_id(id);
  save.set_path(dir);
  TALLY_ASSERT_OK_AND_ASSIGN(v1::SaveCheckpointResponse saved,
                             client_->SaveCheckpoint(save));
  EXPECT_EQ(saved.path(), dir);
  EXPECT_EQ(saved.step(), 3);
  uint64_t file_bytes = 0;
  for (const char* file :
       {"config.json", "model.safetensors", "optimizer.safetensors",
        "server_state.bin", "tally.json", "checksums.sha256"}) {
    const std::filesystem::path path = std::filesystem::path(dir) / file;
    ASSERT_TRUE(std::filesystem::is_regular_file(path)) << path;
    file_bytes += std::filesystem::file_size(path);
  }
  EXPECT_EQ(saved.bytes_written(), file_bytes);

  // Step 4, remembered so it can be replayed after the load.
  TALLY_ASSERT_OK_AND_ASSIGN(v1::OptimStepResponse fourth,
                             TrainStep(*client_, id, 3));
  ASSERT_EQ(fourth.step(), 4);
  TALLY_ASSERT_OK_AND_ASSIGN(const double loss_at_4, ProbeLoss(*client_, id));
  EXPECT_NE(loss_at_4, loss_at_3);

  const std::vector<v1::Sample> pending = TrainingCall(9, 0);
  ASSERT_TRUE(
      client_->ForwardBackward(ForwardBackwardRequest(id, pending)).ok());
  v1::LoadCheckpointRequest load;
  load.set_model_id(id);
  load.set_path(dir);
  load.set_load_optimizer(true);
  TALLY_ASSERT_OK_AND_ASSIGN(v1::LoadCheckpointResponse loaded,
                             client_->LoadCheckpoint(load));
  EXPECT_EQ(loaded.model().step(), 3);
  EXPECT_EQ(loaded.model().accumulated_calls(), 0);
  EXPECT_EQ(loaded.model().accumulated_tokens(), 0);
  EXPECT_EQ(loaded.discarded_calls(), 1);
  EXPECT_EQ(loaded.discarded_tokens(), CountValid(pending).tokens);
  EXPECT_EQ(loaded.discarded_samples(), CountValid(pending).samples);
  v1::GetModelRequest get;
  get.set_model_id(id);
  TALLY_ASSERT_OK_AND_ASSIGN(v1::ModelInfo info, client_->GetModel(get));
  EXPECT_EQ(info.step(), 3);
  EXPECT_EQ(info.accumulated_calls(), 0);
  TALLY_ASSERT_OK_AND_ASSIGN(const double reloaded_loss,
                             ProbeLoss(*client_, id));
  EXPECT_EQ(reloaded_loss, loss_at_3);  // bit for bit: fp64 weights restored

  // Replaying step 4 reproduces it only if the Adam moments and step count
  // came back too (fresh moments give a different update).
  TALLY_ASSERT_OK_AND_ASSIGN(v1::OptimStepResponse replayed,
                             TrainStep(*client_, id, 3));
  EXPECT_EQ(replayed.step(), 4);
  EXPECT_DOUBLE_EQ(replayed.grad_norm(), fourth.grad_norm());
  TALLY_ASSERT_OK_AND_ASSIGN(const double replayed_loss,
                             ProbeLoss(*client_, id));
  EXPECT_DOUBLE_EQ(replayed_loss, loss_at_4);
}

TEST_F(ServerE2eTest, InvalidArgumentsNameTheFieldAndChangeNothing) {
  const std::string id = "tiny";
  ASSERT_NO_FATAL_FAILURE(CreateTrainedModelWithPendingCall(id));

  std::mt19937 rng(11);
  const std::vector<v1::Sample> valid = {MakeSample(rng, kVocab, 12, 2),
                                         MakeSample(rng, kVocab, 9, 2)};
  // `valid` with `edit` applied, sent as a ForwardBackward.
  auto forward_backward =
      [&](std::function<void(v1::ForwardBackwardRequest&)> edit) {
        return [this, id, valid, edit] {
          v1::ForwardBackwardRequest request =
              ForwardBackwardRequest(id, valid);
          edit(request);
          return client_->ForwardBackward(request).status();
        };
      };
  auto create_model = [&](std::function<void(v1::CreateModelRequest&)> edit) {
    return [this, edit] {
      v1::CreateModelRequest request = TinyModelRequest("tiny-2", 5);
      edit(request);
      return client_->CreateModel(request).status();
    };
  };
  auto optim_step = [&](std::function<void(v1::OptimStepRequest&)> edit) {
    return [this, id, edit] {
      v1::OptimStepRequest request = OptimStepRequest(id);
      edit(request);
      return client_->OptimStep(request).status();
    };
  };
  auto weights = [](v1::Sample* sample) {
    sample->clear_weights();
    for (int i = 0; i < sample->input_tokens_size(); ++i) {
      sample->add_weights(1.0f);
    }
    return sample->mutable_weights();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const std::vector<Rejection> rejections = {
      {"input token = vocab",
       "ForwardBackward",
       forward_backward(
           [](auto& r) { r.mutable_samples(1)->set_input_tokens(2, kVocab); }),
       kInvalid,
       {"samples[1].input_tokens[2]"}},
      {"negative input token",
       "ForwardBackward",
       forward_backward(
           [](auto& r) { r.mutable_samples(0)->set_input_tokens(0, -1); }),
       kInvalid,
       {"samples[0].input_tokens[0]"}},
      {"target token = vocab",
       "ForwardBackward",
       forward_backward(
           [](auto& r) { r.mutable_samples(1)->set_target_tokens(3, kVocab); }),
       kInvalid,
       {"samples[1].target_tokens[3]"}},
      {"negative target other than -100",
       "ForwardBackward",
       forward_backward(
           [](auto& r) { r.mutable_samples(0)->set_target_tokens(5, -7); }),
       kInvalid,
       {"samples[0].target_tokens[5]"}},
      {"target/input length mismatch",
       "ForwardBackward",
       forward_backward([](auto& r) {
         r.mutable_samples(1)->mutable_target_tokens()->RemoveLast();
       }),
       kInvalid,
       {"samples[1].target_tokens"}},
      {"weights length mismatch",
       "ForwardBackward",
       forward_backward([](auto& r) {
         for (int i = 0; i < 3; ++i) r.mutable_samples(0)->add_weights(1.0f);
       }),
       kInvalid,
       {"samples[0].weights"}},
      {"no samples",
       "ForwardBackward",
       forward_backward([](auto& r) { r.clear_samples(); }),
       kInvalid,
       {"samples"}},
      {"sample longer than max_position_embeddings",
       "ForwardBackward",
       forward_backward([](auto& r) {
         v1::Sample* sample = r.mutable_samples(1);
         while (sample->input_tokens_size() <= kMaxPositions) {
           sample->add_input_tokens(1);
           sample->add_target_tokens(2);
         }
       }),
       kInvalid,
       {"samples[1].input_tokens", "max_position_embeddings"}},
      {"NaN weight",
       "ForwardBackward",
       forward_backward([&](auto& r) {
         weights(r.mutable_samples(0))
             ->Set(1, std::numeric_limits<float>::quiet_NaN());
       }),
       kInvalid,
       {"samples[0].weights[1]"}},
      {"infinite weight",
       "ForwardBackward",
       forward_backward([&](auto& r) {
         weights(r.mutable_samples(0))
             ->Set(4, -std::numeric_limits<float>::infinity());
       }),
       kInvalid,
       {"samples[0].weights[4]"}},
      {"unknown loss_fn",
       "ForwardBackward",
       forward_backward(
           [](auto& r) { r.set_loss_fn(static_cast<v1::LossFn>(42)); }),
       kInvalid,
       {"loss_fn", "42"}},
      {"a loss_fn_config key the loss does not read",
       "ForwardBackward",
       forward_backward([](auto& r) {
         r.set_loss_fn(v1::LOSS_FN_PPO);
         (*r.mutable_loss_fn_config())["clip_epsilon"] = 0.2;
       }),
       kInvalid,
       {"loss_fn_config[\"clip_epsilon\"]", "clip_low_threshold"}},
      {"dro without beta",
       "ForwardBackward",
       forward_backward([](auto& r) { r.set_loss_fn(v1::LOSS_FN_DRO); }),
       kInvalid,
       {"loss_fn_config[\"beta\"]", "required"}},
      {"ppo without advantages",
       "ForwardBackward",
       forward_backward([](auto& r) {
         r.set_loss_fn(v1::LOSS_FN_PPO);
         for (v1::Sample& sample : *r.mutable_samples()) {
           for (int t = 0; t < sample.input_tokens_size(); ++t) {
             sample.add_sampling_logprobs(-1.0f);
           }
         }
       }),
       kInvalid,
       {"samples[0].advantages", "ppo"}},
      {"NaN sampling_logprobs",
       "ForwardBackward",
       forward_backward([](auto& r) {
         v1::Sample* sample = r.mutable_samples(1);
         for (int t = 0; t < sample->input_tokens_size(); ++t) {
           sample->add_sampling_logprobs(
               t == 2 ? std::numeric_limits<float>::quiet_NaN() : -1.0f);
         }
       }),
       kInvalid,
       {"samples[1].sampling_logprobs[2]"}},
      {"advantages length mismatch",
       "ForwardBackward",
       forward_backward(
           [](auto& r) { r.mutable_samples(0)->add_advantages(1.0f); }),
       kInvalid,
       {"samples[0].advantages has 1 entries"}},
      {"model id with a space and a slash",
       "ForwardBackward",
       forward_backward([](auto& r) { r.set_model_id("bad id/x"); }),
       kInvalid,
       {"model_id"}},
      {"unknown reduction",
       "ForwardBackward",
       forward_backward([](auto& r) {
         r.set_reduction(static_cast<v1::LossReduction>(99));
       }),
       kInvalid,
       {"reduction", "99"}},
      {"heads do not divide hidden",
       "CreateModel",
       create_model([](auto& r) {
         r.mutable_config()->set_num_attention_heads(5);
         r.mutable_config()->set_num_key_value_heads(5);
       }),
       kInvalid,
       {"config.num_attention_heads"}},
      {"model id with a slash",
       "CreateModel",
       create_model([](auto& r) { r.set_model_id("a/b"); }),
       kInvalid,
       {"model_id"}},
      {"unknown dtype",
       "CreateModel",
       create_model([](auto& r) { r.set_dtype(static_cast<v1::DType>(7)); }),
       kInvalid,
       {"dtype"}},
      {"negative default_max_grad_norm",
       "CreateModel",
       create_model([](auto& r) { r.set_default_max_grad_norm(-1.0); }),
       kInvalid,
       {"default_max_grad_norm"}},
      {"default_adam.beta1 = 1.5",
       "CreateModel",
       create_model([](auto& r) { r.mutable_default_adam()->set_beta1(1.5); }),
       kInvalid,
       {"default_adam.beta1"}},
      {"negative max_grad_norm",
       "OptimStep",
       optim_step([](auto& r) { r.set_max_grad_norm(-1.0); }),
       kInvalid,
       {"max_grad_norm"}},
      {"adam.beta1 = 1.5",
       "OptimStep",
       optim_step([](auto& r) { r.mutable_adam()->set_beta1(1.5); }),
       kInvalid,
       {"adam.beta1"}},
      {"NaN learning rate",
       "OptimStep",
       optim_step([](auto& r) {
         r.mutable_adam()->set_learning_rate(
             std::numeric_limits<double>::quiet_NaN());
       }),
       kInvalid,
       {"adam.learning_rate"}},
      {"unknown norm type",
       "OptimStep",
       optim_step(
           [](auto& r) { r.set_norm_type(static_cast<v1::NormType>(42)); }),
       kInvalid,
       {"norm_type"}},
  };
  ExpectRejectedWithoutEffect(id, rejections);
}

TEST_F(ServerE2eTest, UnknownModelsAndDuplicatesChangeNothing) {
  const std::string id = "tiny";
  ASSERT_NO_FATAL_FAILURE(CreateTrainedModelWithPendingCall(id));
  const std::string ghost = "ghost-model";
  const std::string missing_dir =
      server_->scratch_dir() + "/no-such-checkpoint";
  const auto kNotFound = absl::StatusCode::kNotFound;
  const std::vector<Rejection> rejections = {
      {"ForwardBackward on an unknown model",
       "ForwardBackward",
       [&] {
         return client_
             ->ForwardBackward(ForwardBackwardRequest(ghost, ProbeSamples()))
             .status();
       },
       kNotFound,
       {ghost}},
      {"OptimStep on an unknown model",
       "OptimStep",
       [&] { return client_->OptimStep(OptimStepRequest(ghost)).status(); },
       kNotFound,
       {ghost}},
      {"GetModel of an unknown model",
       "GetModel",
       [&] {
         v1::GetModelRequest request;
         request.set_model_id(ghost);
         return client_->GetModel(request).status();
       },
       kNotFound,
       {ghost}},
      {"DeleteModel of an unknown model",
       "DeleteModel",
       [&] {
         v1::DeleteModelRequest request;
         request.set_model_id(ghost);
         return client_->DeleteModel(request).status();
       },
       kNotFound,
       {ghost}},
      {"LoadCheckpoint from a missing directory",
       "LoadCheckpoint",
       [&] {
         v1::LoadCheckpointRequest request;
         request.set_model_id(id);
         request.set_path(missing_dir);
         request.set_load_optimizer(true);
         return client_->LoadCheckpoint(request).status();
       },
       kNotFound,
       {missing_dir}},
      {"CreateModel with an existing id",
       "CreateModel",
       [&] { return client_->CreateModel(TinyModelRequest(id, 99)).status(); },
       absl::StatusCode::kAlreadyExists,
       {id}},
  };
  ExpectRejectedWithoutEffect(id, rejections);
}

TEST_F(ServerE2eTest, FailedPreconditionsKeepTheWindow) {
  const std::string id = "tiny";
  ASSERT_TRUE(client_->CreateModel(TinyModelRequest(id, 3)).ok());
  TALLY_ASSERT_OK_AND_ASSIGN(v1::OptimStepResponse first,
                             TrainStep(*client_, id, 0));
  ASSERT_EQ(first.step(), 1);

  // Nothing accumulated.
  TALLY_ASSERT_OK_AND_ASSIGN(const ModelState empty, Observe(*client_, id));
  absl::Status status = client_->OptimStep(OptimStepRequest(id)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  TALLY_ASSERT_OK_AND_ASSIGN(ModelState now, Observe(*client_, id));
  ExpectUnchanged(empty, now);

  // A window whose only call has every target ignored.
  std::vector<v1::Sample> ignored = TrainingCall(1, 1);
  for (v1::Sample& sample : ignored) {
    for (int i = 0; i < sample.target_tokens_size(); ++i) {
      sample.set_target_tokens(i, kIgnoredTarget);
    }
  }
  TALLY_ASSERT_OK_AND_ASSIGN(
      v1::ForwardBackwardResponse nothing_valid,
      client_->ForwardBackward(ForwardBackwardRequest(id, ignored)));
  EXPECT_EQ(nothing_valid.valid_tokens(), 0);
  EXPECT_EQ(nothing_valid.num_samples(), 0);
  EXPECT_EQ(nothing_valid.accumulated_calls(), 1);
  TALLY_ASSERT_OK_AND_ASSIGN(const ModelState ignored_window,
                             Observe(*client_, id));
  EXPECT_EQ(ignored_window.calls, 1);
  EXPECT_EQ(ignored_window.tokens, 0);
  status = client_->OptimStep(OptimStepRequest(id)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("valid token"));
  TALLY_ASSERT_OK_AND_ASSIGN(now, Observe(*client_, id));
  ExpectUnchanged(ignored_window, now);
  v1::AbortAccumulationRequest abort;
  abort.set_model_id(id);
  TALLY_ASSERT_OK_AND_ASSIGN(v1::AbortAccumulationResponse aborted,
                             client_->AbortAccumulation(abort));
  EXPECT_EQ(aborted.discarded_calls(), 1);
  EXPECT_EQ(aborted.discarded_tokens(), 0);

  // SAMPLE_MEAN while a TOKEN_MEAN window is pending.
  const std::vector<v1::Sample> token_mean_call = TrainingCall(1, 2);
  ASSERT_TRUE(
      client_->ForwardBackward(ForwardBackwardRequest(id, token_mean_call))
          .ok());
  TALLY_ASSERT_OK_AND_ASSIGN(const ModelState token_mean_window,
                             Observe(*client_, id));
  EXPECT_EQ(token_mean_window.pending_reduction, v1::LOSS_REDUCTION_TOKEN_MEAN);
  v1::ForwardBackwardRequest sample_mean =
      ForwardBackwardRequest(id, TrainingCall(1, 0));
  sample_mean.set_reduction(v1::LOSS_REDUCTION_SAMPLE_MEAN);
  status = client_->ForwardBackward(sample_mean).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("reduction"));
  TALLY_ASSERT_OK_AND_ASSIGN(now, Observe(*client_, id));
  ExpectUnchanged(token_mean_window, now);

  // The refused calls left no trace: the step normalizes by the one call.
  TALLY_ASSERT_OK_AND_ASSIGN(v1::OptimStepResponse second,
                             client_->OptimStep(OptimStepRequest(id)));
  EXPECT_EQ(second.step(), 2);
  EXPECT_EQ(second.normalizer(),
            static_cast<double>(CountValid(token_mean_call).tokens));
  ExpectServing(*server_);
}

// GetServerInfo reports the flags the server was started with, the
// compute backend and what CreateModel and ForwardBackward accept.
TEST_F(ServerE2eTest, ServerInfoReportsTheServersFlagsAndCapabilities) {
  ServerProcess* server =
      StartServer({"--max-message-bytes", "12345678", "--max-tokens-per-call",
                   "5000", "--max-batch-tokens", "640", "--max-queued-requests",
                   "77", "--max-memory-bytes", "3000000000", "--threads", "1",
                   "--zero-stage", "2"});
  ASSERT_NE(server, nullptr);
  std::unique_ptr<TrainerClient> client = Connect(*server);
  ASSERT_TRUE(client->WaitForServing(absl::Seconds(30)).ok());
  TALLY_ASSERT_OK_AND_ASSIGN(const v1::ServerInfo info,
                             client->GetServerInfo());
  EXPECT_EQ(info.version(), TALLY_VERSION);
  EXPECT_EQ(info.limits().max_message_bytes(), 12345678);
  EXPECT_EQ(info.limits().max_tokens_per_call(), 5000);
  EXPECT_EQ(info.limits().max_batch_tokens(), 640);
  EXPECT_EQ(info.limits().max_queued_requests(), 77);
  EXPECT_EQ(info.limits().max_memory_bytes(), 3000000000);
  EXPECT_FALSE(info.authentication());
  EXPECT_EQ(info.mesh().world_size(), 1);
  EXPECT_EQ(info.mesh().tp(), 1);
  EXPECT_EQ(info.mesh().zero_stage(), 2);
  EXPECT_EQ(info.compute().threads(), 1);
  EXPECT_THAT(info.compute().blas(),
              ::testing::AnyOf("blis", "openblas", "mkl"));
  EXPECT_FALSE(info.compute().blas_library().empty());
  EXPECT_THAT(info.model_types(),
              ::testing::IsSupersetOf(
                  {"llama", "mistral", "mixtral", "qwen2", "qwen3"}));
  EXPECT_THAT(info.dtypes(), ::testing::Contains(v1::DTYPE_BFLOAT16));
  EXPECT_THAT(info.dtypes(),
              ::testing::Not(::testing::Contains(v1::DTYPE_FLOAT16)));
  // Every LossFn by its name, in the enum's order.
  std::vector<std::string> losses;
  for (int v = v1::LossFn_MIN + 1; v <= v1::LossFn_MAX; ++v) {
    losses.push_back(absl::AsciiStrToLower(
        v1::LossFn_Name(static_cast<v1::LossFn>(v)).substr(8)));
  }
  EXPECT_THAT(info.losses(), ::testing::ElementsAreArray(losses));
  EXPECT_EQ(losses.front(), "cross_entropy");
  EXPECT_EQ(losses.back(), "dro");
  EXPECT_THAT(
      info.features(),
      ::testing::IsSupersetOf({"seq_id", "activation_checkpointing", "lora",
                               "blocked_attention", "zero_stages"}));
  // What it says is what CreateModel takes: a bf16 model with
  // checkpointing of each listed family's shape.
  v1::CreateModelRequest bf16 = TinyModelRequest("bf16", 1);
  bf16.set_dtype(v1::DTYPE_BFLOAT16);
  bf16.set_activation_checkpointing(true);
  TALLY_ASSERT_OK_AND_ASSIGN(const v1::ModelInfo created,
                             client->CreateModel(bf16));
  EXPECT_EQ(created.dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_TRUE(created.activation_checkpointing());
}

TEST_F(ServerE2eTest, ServerRefusesMessagesAboveItsLimit) {
  ServerProcess* small = StartServer({"--max-message-bytes", "65536"});
  ASSERT_NE(small, nullptr);
  // The client's own limit (256 MiB) is far above, so the server refuses.
  std::unique_ptr<TrainerClient> client = Connect(*small);
  ASSERT_TRUE(client->WaitForServing(absl::Seconds(30)).ok());
  const std::string id = "tiny";
  ASSERT_TRUE(client->CreateModel(TinyModelRequest(id, 1)).ok());

  std::mt19937 rng(5);
  std::vector<v1::Sample> samples;
  for (int i = 0; i < 520; ++i)
    samples.push_back(MakeSample(rng, kVocab, 64, 0, ZeroWeightEvery(3)));
  const v1::ForwardBackwardRequest big = ForwardBackwardRequest(id, samples);
  ASSERT_GT(big.ByteSizeLong(), 180'000u);
  ASSERT_LT(big.ByteSizeLong(), 260'000u);
  const absl::Status status = client->ForwardBackward(big).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("65536"));

  v1::GetModelRequest get;
  get.set_model_id(id);
  TALLY_ASSERT_OK_AND_ASSIGN(v1::ModelInfo info, client->GetModel(get));
  EXPECT_EQ(info.step(), 0);
  EXPECT_EQ(info.accumulated_calls(), 0);
  ExpectServing(*small);
  // A request within the limit still goes through.
  const std::vector<v1::Sample> fits = TrainingCall(0, 0);
  TALLY_ASSERT_OK_AND_ASSIGN(
      v1::ForwardBackwardResponse out,
      client->ForwardBackward(ForwardBackwardRequest(id, fits)));
  EXPECT_EQ(out.valid_tokens(), CountValid(fits).tokens);
  EXPECT_EQ(out.accumulated_calls(), 1);
}

TEST_F(ServerE2eTest, ModelsSideBySideDoNotInterfere) {
  ASSERT_TRUE(client_->CreateModel(TinyModelRequest("model-a", 1)).ok());
  ASSERT_TRUE(client_->CreateModel(TinyModelRequest("model-b", 2)).ok());
  const std::vector<v1::Sample> b_call = TrainingCall(4, 1);
  ASSERT_TRUE(
      client_->ForwardBackward(ForwardBackwardRequest("model-b", b_call)).ok());
  TALLY_ASSERT_OK_AND_ASSIGN(const ModelState b_before,
                             Observe(*client_, "model-b"));
  EXPECT_EQ(b_before.calls, 1);

  // A's window starts from nothing although B's is pending.
  ValidCounts a_window;
  for (int call = 0; call < kCallsPerStep; ++call) {
    const std::vector<v1::Sample> samples = TrainingCall(0, call);
    a_window.tokens += CountValid(samples).tokens;
    TALLY_ASSERT_OK_AND_ASSIGN(
        v1::ForwardBackwardResponse out,
        client_->ForwardBackward(ForwardBackwardRequest("model-a", samples)));
    EXPECT_EQ(out.accumulated_calls(), call + 1);
    EXPECT_EQ(out.accumulated_tokens(), a_window.tokens);
    TALLY_ASSERT_OK_AND_ASSIGN(const ModelState b_now,
                               Observe(*client_, "model-b"));
    ExpectUnchanged(b_before, b_now);
  }
  TALLY_ASSERT_OK_AND_ASSIGN(v1::OptimStepResponse a_step,
                             client_->OptimStep(OptimStepRequest("model-a")));
  EXPECT_EQ(a_step.step(), 1);
  EXPECT_EQ(a_step.normalizer(), static_cast<double>(a_window.tokens));
  TALLY_ASSERT_OK_AND_ASSIGN(const ModelState b_after_a_step,
                             Observe(*client_, "model-b"));
  ExpectUnchanged(b_before, b_after_a_step);

  // B steps on its own window only; deleting A leaves B alone.
  TALLY_ASSERT_OK_AND_ASSIGN(v1::OptimStepResponse b_step,
                             client_->OptimStep(OptimStepRequest("model-b")));
  EXPECT_EQ(b_step.step(), 1);
  EXPECT_EQ(b_step.normalizer(),
            static_cast<double>(CountValid(b_call).tokens));
  TALLY_ASSERT_OK_AND_ASSIGN(const ModelState b_stepped,
                             Observe(*client_, "model-b"));
  v1::DeleteModelRequest remove;
  remove.set_model_id("model-a");
  TALLY_ASSERT_OK_AND_ASSIGN(v1::DeleteModelResponse deleted,
                             client_->DeleteModel(remove));
  EXPECT_EQ(deleted.model().step(), 1);
  TALLY_ASSERT_OK_AND_ASSIGN(ModelState b_alone, Observe(*client_, "model-b"));
  EXPECT_EQ(b_alone.num_models, 1);
  b_alone.num_models = b_stepped.num_models;
  ExpectUnchanged(b_stepped, b_alone);
}

TEST_F(ServerE2eTest, SigtermWithAnIdleClientConnectedExitsZero) {
  ASSERT_TRUE(client_->CreateModel(TinyModelRequest("tiny", 1)).ok());
  const absl::Time stop_start = absl::Now();
  const absl::StatusOr<int> exit_code = server_->Stop(kShutdownTimeout);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << server_->ReadLog();
  EXPECT_LT(absl::Now() - stop_start, kShutdownTimeout);
  // Once the server is gone the same client fails fast instead of hanging.
  v1::GetModelRequest get;
  get.set_model_id("tiny");
  EXPECT_EQ(client_->GetModel(get).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(ServerE2eTest, SigtermFinishesTheInFlightCallAndExitsZero) {
  const std::string id = "tiny";
  ASSERT_TRUE(client_->CreateModel(TinyModelRequest(id, 1)).ok());
  // Sized from a timed call so the one in flight at SIGTERM runs ~2 s.
  auto long_call = [&](int num_samples) {
    std::mt19937 rng(17);
    std::vector<v1::Sample> samples;
    for (int i = 0; i < num_samples; ++i) {
      samples.push_back(MakeSample(rng, kVocab, kMaxPositions, 4));
    }
    return ForwardBackwardRequest(id, samples);
  };
  constexpr int kTimedSamples = 64;
  const v1::ForwardBackwardRequest timed = long_call(kTimedSamples);
  const absl::Time timed_start = absl::Now();
  TALLY_ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse first,
                             client_->ForwardBackward(timed));
  const double seconds_per_sample =
      absl::ToDoubleSeconds(absl::Now() - timed_start) / kTimedSamples;
  const int num_samples = std::clamp(static_cast<int>(2.0 / seconds_per_sample),
                                     kTimedSamples, 20'000);
  const v1::ForwardBackwardRequest request = long_call(num_samples);
  const ValidCounts expected =
      CountValid({request.samples().begin(), request.samples().end()});

  std::future<absl::StatusOr<v1::ForwardBackwardResponse>> in_flight =
      std::async(std::launch::async,
                 [&] { return client_->ForwardBackward(request); });
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(in_flight.wait_for(std::chrono::seconds(0)),
            std::future_status::timeout)
      << "the call finished before SIGTERM; nothing was in flight";
  const absl::Time stop_start = absl::Now();
  const absl::StatusOr<int> exit_code = server_->Stop(kShutdownTimeout);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << server_->ReadLog();
  EXPECT_LT(absl::Now() - stop_start, kShutdownTimeout);

  const absl::StatusOr<v1::ForwardBackwardResponse> finished = in_flight.get();
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_EQ(finished->valid_tokens(), expected.tokens);
  EXPECT_EQ(finished->accumulated_calls(), 2);
  EXPECT_EQ(finished->accumulated_tokens(),
            first.valid_tokens() + expected.tokens);
}

}  // namespace
}  // namespace tally
