// TrainerClient's retries against a fake server that fails on command: which
// calls are retried (by ErrorReason), that a retry resends the same seq_id,
// and that ABORTED tells the caller to abort the window.
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "base/error_reason.h"
#include "client/trainer_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"

namespace tally {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Fails the first `failures` calls of every method with `code`, then
// succeeds; records the seq_id of every call it receives.
class FlakyTrainer : public v1::Trainer::Service {
 public:
  // `failure` as the server sends it, ErrorReason included.
  void FailNext(int failures, absl::Status failure) {
    absl::MutexLock lock(&mu_);
    failures_ = failures;
    failure_ = ToGrpcStatus(failure);
  }

  std::vector<uint64_t> seq_ids() {
    absl::MutexLock lock(&mu_);
    return seq_ids_;
  }

  grpc::Status ForwardBackward(grpc::ServerContext*,
                               const v1::ForwardBackwardRequest* request,
                               v1::ForwardBackwardResponse* response) override {
    response->set_valid_tokens(request->samples_size());
    return Answer(request->seq_id());
  }

  grpc::Status OptimStep(grpc::ServerContext*,
                         const v1::OptimStepRequest* request,
                         v1::OptimStepResponse* response) override {
    response->set_step(7);
    return Answer(request->seq_id());
  }

  grpc::Status ListModels(grpc::ServerContext*, const v1::ListModelsRequest*,
                          v1::ListModelsResponse*) override {
    return Answer(0);
  }

 private:
  grpc::Status Answer(uint64_t seq_id) {
    absl::MutexLock lock(&mu_);
    seq_ids_.push_back(seq_id);
    if (failures_ == 0) return grpc::Status::OK;
    --failures_;
    return failure_;
  }

  absl::Mutex mu_;
  int failures_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::Status failure_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> seq_ids_ ABSL_GUARDED_BY(mu_);
};

class TrainerClientRetryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(&trainer_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override { server_->Shutdown(); }

  TrainerClient Client(int max_attempts) const {
    TrainerClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(port_);
    options.retry.max_attempts = max_attempts;
    options.retry.initial_backoff = absl::Milliseconds(1);
    options.retry.max_backoff = absl::Milliseconds(4);
    return TrainerClient(options);
  }

  static v1::ForwardBackwardRequest Sequenced(uint64_t seq_id) {
    v1::ForwardBackwardRequest request;
    request.set_model_id("m");
    request.set_seq_id(seq_id);
    request.add_samples();
    request.add_samples();
    return request;
  }

  FlakyTrainer trainer_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(TrainerClientRetryTest, RetriesTransientFailuresWithTheSameSeqId) {
  for (const absl::Status& failure :
       {absl::UnavailableError("injected"),
        absl::DeadlineExceededError("injected"),
        WithReason(absl::ResourceExhaustedError("injected"),
                   ErrorReason::kQueueFull),
        WithReason(absl::UnavailableError("injected"),
                   ErrorReason::kShuttingDown)}) {
    SCOPED_TRACE(failure.ToString());
    trainer_.FailNext(2, failure);
    const size_t before = trainer_.seq_ids().size();
    auto response = Client(5).ForwardBackward(Sequenced(41));
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->valid_tokens(), 2);
    const std::vector<uint64_t> seen = trainer_.seq_ids();
    EXPECT_THAT(std::vector<uint64_t>(seen.begin() + before, seen.end()),
                ElementsAre(41, 41, 41));
  }
}

// RESOURCE_EXHAUSTED is retried only as QUEUE_FULL: a message too large
// (gRPC's own, without a reason, or the server's refusal of a response that
// would not fit) or a memory limit fails the same way every time.
TEST_F(TrainerClientRetryTest, NeverRetriesWhatCannotFit) {
  for (const absl::Status& failure :
       {absl::ResourceExhaustedError("injected"),
        WithReason(absl::ResourceExhaustedError("injected"),
                   ErrorReason::kMessageTooLarge),
        WithReason(absl::ResourceExhaustedError("injected"),
                   ErrorReason::kMemoryLimit)}) {
    SCOPED_TRACE(failure.ToString());
    trainer_.FailNext(1, failure);
    const size_t before = trainer_.seq_ids().size();
    const absl::Status status =
        Client(5).ForwardBackward(Sequenced(8)).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(ReasonOf(status), ReasonOf(failure));
    EXPECT_EQ(trainer_.seq_ids().size(), before + 1);
  }
}

TEST_F(TrainerClientRetryTest, GivesUpAfterMaxAttempts) {
  trainer_.FailNext(100, absl::UnavailableError("injected"));
  auto response = Client(3).ForwardBackward(Sequenced(5));
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(trainer_.seq_ids(), ElementsAre(5, 5, 5));
}

TEST_F(TrainerClientRetryTest, NeverRetriesAnUnsequencedMutation) {
  trainer_.FailNext(1, absl::UnavailableError("injected"));
  auto response = Client(5).ForwardBackward(Sequenced(0));
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(trainer_.seq_ids().size(), 1u);
}

TEST_F(TrainerClientRetryTest, RetriesReadOnlyCalls) {
  trainer_.FailNext(2, absl::UnavailableError("injected"));
  EXPECT_TRUE(Client(5).ListModels(v1::ListModelsRequest()).ok());
  EXPECT_EQ(trainer_.seq_ids().size(), 3u);
}

TEST_F(TrainerClientRetryTest, DoesNotRetryPermanentErrors) {
  trainer_.FailNext(1, absl::InvalidArgumentError("injected"));
  EXPECT_EQ(Client(5).ForwardBackward(Sequenced(3)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(trainer_.seq_ids().size(), 1u);
}

TEST_F(TrainerClientRetryTest, AbortedTellsTheCallerToAbortTheWindow) {
  trainer_.FailNext(1, WithReason(absl::AbortedError("injected"),
                                  ErrorReason::kWindowPoisoned));
  v1::OptimStepRequest request;
  request.set_model_id("m");
  request.set_seq_id(9);
  auto response = Client(5).OptimStep(request);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(response.status().message()),
              HasSubstr("call AbortAccumulation"));
  EXPECT_EQ(ReasonOf(response.status()), ErrorReason::kWindowPoisoned);
  EXPECT_THAT(trainer_.seq_ids(), ElementsAre(9));
}

}  // namespace
}  // namespace tally
