#include "client/trainer_client.h"

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tally {
namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;

// Answers from fixed rules so the client's translation can be checked.
class FakeTrainer : public v1::Trainer::Service {
 public:
  grpc::Status GetModel(grpc::ServerContext*,
                        const v1::GetModelRequest* request,
                        v1::ModelInfo* response) override {
    if (request->model_id() != "demo") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          "model_id '" + request->model_id() + "' not found");
    }
    response->set_model_id("demo");
    response->set_step(41);
    return grpc::Status::OK;
  }

  // Reports the token count it received, so large requests are verified.
  grpc::Status ForwardBackward(grpc::ServerContext*,
                               const v1::ForwardBackwardRequest* request,
                               v1::ForwardBackwardResponse* response) override {
    int64_t tokens = 0;
    for (const v1::Sample& sample : request->samples()) {
      tokens += sample.input_tokens_size();
    }
    response->set_valid_tokens(tokens);
    return grpc::Status::OK;
  }

  grpc::Status OptimStep(grpc::ServerContext*, const v1::OptimStepRequest*,
                         v1::OptimStepResponse* response) override {
    absl::SleepFor(absl::Milliseconds(400));
    response->set_step(1);
    return grpc::Status::OK;
  }
};

// NOT_SERVING for the first `not_serving_checks` calls, then SERVING.
class FakeHealth : public grpc::health::v1::Health::Service {
 public:
  explicit FakeHealth(int not_serving_checks)
      : not_serving_checks_(not_serving_checks) {}

  grpc::Status Check(grpc::ServerContext*, const HealthCheckRequest*,
                     HealthCheckResponse* response) override {
    const int call = checks_.fetch_add(1);
    response->set_status(call < not_serving_checks_
                             ? HealthCheckResponse::NOT_SERVING
                             : HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }

  int checks() const { return checks_.load(); }

 private:
  const int not_serving_checks_;
  std::atomic<int> checks_{0};
};

class TrainerClientTest : public ::testing::Test {
 protected:
  void StartServer(int not_serving_checks) {
    health_ = std::make_unique<FakeHealth>(not_serving_checks);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.RegisterService(&trainer_);
    builder.RegisterService(health_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }

  TrainerClientOptions Options() const {
    TrainerClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(port_);
    return options;
  }

  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  FakeTrainer trainer_;
  std::unique_ptr<FakeHealth> health_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(TrainerClientTest, ReturnsResponsesAndKeepsErrorCodesAndMessages) {
  StartServer(0);
  TrainerClient client(Options());

  v1::GetModelRequest request;
  request.set_model_id("demo");
  auto found = client.GetModel(request);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->step(), 41);

  request.set_model_id("ghost");
  auto missing = client.GetModel(request);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), "model_id 'ghost' not found");

  // Not implemented by the fake: the server's UNIMPLEMENTED comes through.
  auto unimplemented = client.ListModels(v1::ListModelsRequest());
  EXPECT_EQ(unimplemented.status().code(), absl::StatusCode::kUnimplemented);
}

TEST_F(TrainerClientTest, RaisesTheDefaultFourMebibyteMessageLimit) {
  StartServer(0);
  // 3M tokens of id 256 are two varint bytes each: ~6 MiB on the wire.
  constexpr int kTokens = 3'000'000;
  v1::ForwardBackwardRequest request;
  v1::Sample* sample = request.add_samples();
  sample->mutable_input_tokens()->Resize(kTokens, 256);
  ASSERT_GT(request.ByteSizeLong(), 4u << 20);

  TrainerClient client(Options());
  auto response = client.ForwardBackward(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->valid_tokens(), kTokens);

  TrainerClientOptions small = Options();
  small.max_message_bytes = 4 << 20;
  TrainerClient limited(small);
  EXPECT_EQ(limited.ForwardBackward(request).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(TrainerClientTest, AppliesThePerCallDeadline) {
  StartServer(0);
  TrainerClientOptions options = Options();
  options.deadline = absl::Milliseconds(100);
  TrainerClient client(options);
  EXPECT_EQ(client.OptimStep(v1::OptimStepRequest()).status().code(),
            absl::StatusCode::kDeadlineExceeded);

  options.deadline = absl::Seconds(30);
  TrainerClient patient(options);
  auto stepped = patient.OptimStep(v1::OptimStepRequest());
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->step(), 1);
}

TEST_F(TrainerClientTest, WaitForServingPollsUntilServing) {
  StartServer(3);
  TrainerClient client(Options());
  EXPECT_TRUE(client.WaitForServing(absl::Seconds(30)).ok());
  EXPECT_EQ(health_->checks(), 4);
}

TEST_F(TrainerClientTest, WaitForServingTimesOutWithTheLastAnswer) {
  StartServer(1'000'000);
  TrainerClient client(Options());
  const absl::Time start = absl::Now();
  absl::Status status = client.WaitForServing(absl::Milliseconds(500));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(status.message()), HasSubstr("NOT_SERVING"));
  EXPECT_GE(health_->checks(), 2);
  EXPECT_GE(waited, absl::Milliseconds(500));
  EXPECT_LT(waited, absl::Seconds(5));
}

TEST(TrainerClientUnreachableTest, CallsFailWithUnavailable) {
  TrainerClientOptions options;
  options.target = "127.0.0.1:1";  // nothing listens on port 1
  TrainerClient client(options);
  EXPECT_EQ(client.ListModels(v1::ListModelsRequest()).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tally
