// End-to-end reliability tests of tally-server (docs/reliability.md): real
// server processes driven over raw gRPC stubs (so no client-side retry hides
// what the server answered). Sequenced requests run once and in order,
// retries get the original response, gaps time out into a poisoned window,
// requests that expired or were cancelled before they ran are not executed,
// the request budget refuses at once (and never the retry a window waits
// for), retries get the first answer's bytes, SIGTERM drains and finishes, and
// randomized hostile clients and a 32-client soak leave the models exactly
// where a clean run puts them.
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/client_interceptor.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/error_reason.h"
#include "client/trainer_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"
#include "tally/v1/trainer.grpc.pb.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/server_process.h"

namespace tally {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::grpc::health::v1::HealthCheckResponse;
using ::tally::testing::CheckHealth;
using ::tally::testing::HttpGet;
using ::tally::testing::kTinyVocab;
using ::tally::testing::MetricValue;
using ::tally::testing::ServerProcess;
using ::tally::testing::ValidTokens;
using ::testing::HasSubstr;

using Stub = v1::Trainer::Stub;
constexpr absl::Duration kCallDeadline = absl::Seconds(60);
constexpr absl::Duration kShutdownTimeout = absl::Seconds(30);

// One RPC through a raw stub with a deadline `deadline` from now.
template <typename Request, typename Response>
absl::StatusOr<Response> Send(grpc::Status (Stub::*method)(grpc::ClientContext*,
                                                           const Request&,
                                                           Response*),
                              Stub& stub, const Request& request,
                              absl::Duration deadline = kCallDeadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  Response response;
  const grpc::Status status = (stub.*method)(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

// `count` next-token samples of `length` random tokens from `seed`.
std::vector<v1::Sample> Samples(uint64_t seed, int count = 2, int length = 12) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_int_distribution<int32_t> token(0, kTinyVocab - 1);
  std::vector<v1::Sample> samples;
  for (int s = 0; s < count; ++s) {
    std::vector<int32_t> text(length + 1);
    for (int32_t& t : text) t = token(rng);
    v1::Sample sample;
    for (int i = 0; i < length; ++i) {
      sample.add_input_tokens(text[i]);
      sample.add_target_tokens(i < 2 ? testing::kIgnoredTarget : text[i + 1]);
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

v1::ForwardBackwardRequest Fb(const std::string& model_id, uint64_t seq_id,
                              const std::vector<v1::Sample>& samples) {
  v1::ForwardBackwardRequest request;
  request.set_model_id(model_id);
  request.set_seq_id(seq_id);
  for (const v1::Sample& sample : samples) *request.add_samples() = sample;
  return request;
}

v1::OptimStepRequest Step(const std::string& model_id, uint64_t seq_id) {
  v1::OptimStepRequest request;
  request.set_model_id(model_id);
  request.set_seq_id(seq_id);
  return request;
}

v1::GetModelRequest Get(const std::string& model_id) {
  v1::GetModelRequest request;
  request.set_model_id(model_id);
  return request;
}

// The bytes of `method`'s response to `request` as the server sent them,
// unparsed, or the error.
absl::StatusOr<std::string> RawCall(grpc::GenericStub& stub,
                                    const std::string& method,
                                    const google::protobuf::Message& request) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
  const std::string bytes = request.SerializeAsString();
  grpc::Slice slice(bytes);
  grpc::ByteBuffer sent(&slice, 1);
  grpc::ByteBuffer received;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, absl::StrCat("/tally.v1.Trainer/", method),
                 grpc::StubOptions(), &sent, &received,
                 [&done](grpc::Status status) { done.set_value(status); });
  const grpc::Status status = done.get_future().get();
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  if (!received.Dump(&slices).ok()) return absl::InternalError("no response");
  std::string response;
  for (const grpc::Slice& part : slices) {
    response.append(reinterpret_cast<const char*>(part.begin()), part.size());
  }
  return response;
}

int64_t TokensOf(const std::vector<v1::Sample>& samples) {
  int64_t tokens = 0;
  for (const v1::Sample& sample : samples) tokens += ValidTokens(sample);
  return tokens;
}

// Adds "authorization: Bearer <token>" to every call of a channel. Call
// credentials need a secure channel, and these servers are plaintext on
// loopback.
class BearerToken : public grpc::experimental::Interceptor {
 public:
  explicit BearerToken(std::string token) : token_(std::move(token)) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert(
          {"authorization", absl::StrCat("Bearer ", token_)});
    }
    methods->Proceed();
  }

 private:
  std::string token_;
};

class BearerTokenFactory
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenFactory(std::string token) : token_(std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerToken(token_);
  }

 private:
  std::string token_;
};

class ReliabilityE2eTest : public ::testing::Test {
 protected:
  void TearDown() override {
    stubs_.clear();
    testing::ExpectCleanShutdown(servers_, kShutdownTimeout);
  }

  // Starts a server with `args` (its virtual memory capped at
  // `address_space_bytes` when > 0); its stub, or nullptr (test failed).
  // Every stub of the test sends `token` (none when empty).
  Stub* Start(const std::vector<std::string>& args,
              const std::string& token = "", uint64_t address_space_bytes = 0) {
    server_ = testing::StartServerOrFail(args, servers_, address_space_bytes);
    if (server_ == nullptr) return nullptr;
    token_ = token;
    stubs_.push_back(NewStub());
    return stubs_.back().get();
  }

  // Another channel to the server, for a concurrent client; it sends
  // `token`, by default the one given to Start.
  std::unique_ptr<Stub> NewStub(std::optional<std::string> token = {}) {
    TrainerClientOptions options;
    options.target = server_->grpc_target();
    const std::string bearer = token.value_or(token_);
    if (bearer.empty()) {
      return v1::Trainer::NewStub(TrainerClient::MakeChannel(options));
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options.max_message_bytes);
    args.SetMaxSendMessageSize(options.max_message_bytes);
    std::vector<
        std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
        interceptors;
    interceptors.push_back(std::make_unique<BearerTokenFactory>(bearer));
    return v1::Trainer::NewStub(
        grpc::experimental::CreateCustomChannelWithInterceptors(
            options.target, grpc::InsecureChannelCredentials(), args,
            std::move(interceptors)));
  }

  void Create(Stub& stub, const std::string& model_id, uint64_t seed = 3) {
    v1::CreateModelRequest request;
    request.set_model_id(model_id);
    *request.mutable_config() = testing::TinyModelConfig();
    request.set_seed(seed);
    request.set_dtype(v1::DTYPE_FLOAT64);
    request.set_default_max_grad_norm(1.0);
    const auto created = Send(&Stub::CreateModel, stub, request);
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ(created->next_seq_id(), 1u);
  }

  v1::ModelInfo Info(Stub& stub, const std::string& model_id) {
    const auto info = Send(&Stub::GetModel, stub, Get(model_id));
    EXPECT_TRUE(info.ok()) << info.status();
    return info.value_or(v1::ModelInfo());
  }

  // Forward-only loss of fixed samples: a fingerprint of the weights, equal
  // bit for bit in FLOAT64 for equal weights.
  double ProbeLoss(Stub& stub, const std::string& model_id) {
    v1::ForwardBackwardRequest probe = Fb(model_id, 0, Samples(424242, 3, 30));
    probe.set_forward_only(true);
    const auto probed = Send(&Stub::ForwardBackward, stub, probe);
    EXPECT_TRUE(probed.ok()) << probed.status();
    return probed.ok() ? probed->loss_sum() : -1;
  }

  double Metric(const std::string& name,
                const std::map<std::string, std::string>& labels) {
    const absl::StatusOr<std::string> text =
        HttpGet(server_->metrics_port(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    if (!text.ok()) return -1;
    const absl::StatusOr<double> value = MetricValue(*text, name, labels);
    EXPECT_TRUE(value.ok()) << value.status();
    return value.value_or(-1);
  }

  // A forward-only ForwardBackward on `model_id` that keeps the executor
  // busy for about `seconds`, sized from a timed call.
  v1::ForwardBackwardRequest LongCall(Stub& stub, const std::string& model_id,
                                      double seconds) {
    // Timed calls double until one takes a quarter of a second, so that the
    // call's fixed costs (the RPC, planning) do not inflate the per-sample
    // time: with a fast BLAS a small call is mostly overhead, and a long call
    // sized from it would end early.
    constexpr int kMaxSamples = 16'000;  // 1M tokens: --max-tokens-per-call
    int timed_samples = 32;
    double per_sample = 0;
    for (;;) {
      v1::ForwardBackwardRequest timed = Fb(
          model_id, 0, Samples(77, timed_samples, testing::kTinyMaxPositions));
      timed.set_forward_only(true);
      const absl::Time start = absl::Now();
      EXPECT_TRUE(Send(&Stub::ForwardBackward, stub, timed).ok());
      const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
      per_sample = elapsed / timed_samples;
      if (elapsed >= 0.25 || timed_samples * 2 > kMaxSamples) break;
      timed_samples *= 2;
    }
    const int count = std::clamp(static_cast<int>(seconds / per_sample),
                                 timed_samples, kMaxSamples);
    v1::ForwardBackwardRequest long_call =
        Fb(model_id, 0, Samples(78, count, testing::kTinyMaxPositions));
    long_call.set_forward_only(true);
    return long_call;
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  ServerProcess* server_ = nullptr;
  std::vector<std::unique_ptr<Stub>> stubs_;
  // The bearer token every stub sends (none when empty).
  std::string token_;
};

TEST_F(ReliabilityE2eTest, SequencedRequestsRunOnceInOrderAndRetriesReplay) {
  Stub* stub = Start({});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "seq");
  Create(*stub, "clean");

  const auto first =
      Send(&Stub::ForwardBackward, *stub, Fb("seq", 1, Samples(1)));
  ASSERT_TRUE(first.ok()) << first.status();
  const auto retry =
      Send(&Stub::ForwardBackward, *stub, Fb("seq", 1, Samples(1)));
  ASSERT_TRUE(retry.ok()) << retry.status();
  // The cached response: the same message, field for field.
  EXPECT_TRUE(MessageDifferencer::Equals(*retry, *first))
      << retry->DebugString();
  EXPECT_EQ(retry->accumulated_calls(), 1);
  EXPECT_EQ(Info(*stub, "seq").accumulated_calls(), 1);

  const auto clash =
      Send(&Stub::ForwardBackward, *stub, Fb("seq", 1, Samples(9)));
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(clash.status().message()), HasSubstr("seq_id 1 "));

  // 3 overtakes 2 on the wire but waits for it.
  auto third = std::async(std::launch::async, [&] {
    return Send(&Stub::ForwardBackward, *stub, Fb("seq", 3, Samples(3)));
  });
  EXPECT_EQ(third.wait_for(std::chrono::milliseconds(500)),
            std::future_status::timeout);
  const auto second =
      Send(&Stub::ForwardBackward, *stub, Fb("seq", 2, Samples(2)));
  ASSERT_TRUE(second.ok()) << second.status();
  const auto third_done = third.get();
  ASSERT_TRUE(third_done.ok()) << third_done.status();
  EXPECT_EQ(second->accumulated_calls(), 2);
  EXPECT_EQ(third_done->accumulated_calls(), 3);

  const auto stepped = Send(&Stub::OptimStep, *stub, Step("seq", 4));
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  const auto step_retry = Send(&Stub::OptimStep, *stub, Step("seq", 4));
  ASSERT_TRUE(step_retry.ok()) << step_retry.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*step_retry, *stepped));
  EXPECT_EQ(stepped->step(), 1);
  EXPECT_EQ(stepped->normalizer(),
            TokensOf(Samples(1)) + TokensOf(Samples(2)) + TokensOf(Samples(3)));
  const v1::ModelInfo info = Info(*stub, "seq");
  EXPECT_EQ(info.step(), 1);
  EXPECT_EQ(info.next_seq_id(), 5u);
  EXPECT_EQ(info.accumulated_calls(), 0);

  // The same window unsequenced, once each: the same weights, bit for bit.
  for (uint64_t seed : {1, 2, 3}) {
    ASSERT_TRUE(
        Send(&Stub::ForwardBackward, *stub, Fb("clean", 0, Samples(seed)))
            .ok());
  }
  const auto clean_step = Send(&Stub::OptimStep, *stub, Step("clean", 0));
  ASSERT_TRUE(clean_step.ok()) << clean_step.status();
  EXPECT_EQ(clean_step->grad_norm(), stepped->grad_norm());
  EXPECT_EQ(ProbeLoss(*stub, "seq"), ProbeLoss(*stub, "clean"));
  EXPECT_EQ(Info(*stub, "clean").next_seq_id(), 1u);  // unsequenced

  EXPECT_EQ(Metric("tally_duplicate_requests_total", {{"model_id", "seq"}}), 2);
  // The third call waited at least 0.5 s for the second before it ran;
  // every executed call was observed: the window's three, "clean"'s three
  // and the two probes (retries answered from the cache never ran).
  const std::map<std::string, std::string> fb = {{"method", "ForwardBackward"}};
  EXPECT_GE(Metric("tally_queue_wait_seconds_sum", fb), 0.5);
  EXPECT_EQ(Metric("tally_queue_wait_seconds_count", fb), 8);
  EXPECT_EQ(Metric("tally_queue_wait_seconds_count", {{"method", "OptimStep"}}),
            2);
}

TEST_F(ReliabilityE2eTest, AGapTimesOutIntoAPoisonedWindowUntilAborted) {
  Stub* stub = Start({"--seq-gap-timeout-secs", "1"});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "gap");
  ASSERT_TRUE(
      Send(&Stub::ForwardBackward, *stub, Fb("gap", 1, Samples(1))).ok());

  const absl::Time start = absl::Now();
  const auto ahead =
      Send(&Stub::ForwardBackward, *stub, Fb("gap", 3, Samples(3)));
  EXPECT_GE(absl::Now() - start, absl::Seconds(1));
  EXPECT_EQ(ahead.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(ahead.status().message()), HasSubstr("seq_id 2,"));
  v1::ModelInfo info = Info(*stub, "gap");
  EXPECT_EQ(info.next_seq_id(), 2u);
  EXPECT_EQ(info.accumulated_calls(), 1);

  // The late seq_id 2 still runs, but the window cannot step.
  const auto late =
      Send(&Stub::ForwardBackward, *stub, Fb("gap", 2, Samples(2)));
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->accumulated_calls(), 2);
  const double before = ProbeLoss(*stub, "gap");
  const auto refused = Send(&Stub::OptimStep, *stub, Step("gap", 3));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("poisoned"));
  EXPECT_EQ(Info(*stub, "gap").step(), 0);
  EXPECT_EQ(ProbeLoss(*stub, "gap"), before);

  v1::AbortAccumulationRequest abort;
  abort.set_model_id("gap");
  abort.set_seq_id(4);
  const auto aborted = Send(&Stub::AbortAccumulation, *stub, abort);
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_EQ(aborted->discarded_calls(), 2);
  ASSERT_TRUE(
      Send(&Stub::ForwardBackward, *stub, Fb("gap", 5, Samples(5))).ok());
  const auto stepped = Send(&Stub::OptimStep, *stub, Step("gap", 6));
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->step(), 1);
  EXPECT_EQ(stepped->normalizer(), TokensOf(Samples(5)));

  EXPECT_EQ(Metric("tally_poisoned_windows_total", {{"model_id", "gap"}}), 1);
  EXPECT_GE(Metric("tally_seq_gap_wait_seconds_sum", {}), 1.0);
}

TEST_F(ReliabilityE2eTest, RequestsThatExpireOrAreCancelledBeforeRunningDoNot) {
  Stub* stub = Start({});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "d");
  const v1::ForwardBackwardRequest long_call = LongCall(*stub, "d", 2.0);
  auto busy = std::async(std::launch::async, [&] {
    return Send(&Stub::ForwardBackward, *stub, long_call);
  });
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(busy.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the long call finished too early";

  const auto expired = Send(&Stub::ForwardBackward, *stub,
                            Fb("d", 1, Samples(1)), absl::Milliseconds(300));
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kDeadlineExceeded);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
  std::thread canceller([&context] {
    absl::SleepFor(absl::Milliseconds(300));
    context.TryCancel();
  });
  v1::ForwardBackwardResponse ignored;
  const grpc::Status cancelled =
      stub->ForwardBackward(&context, Fb("d", 0, Samples(2)), &ignored);
  canceller.join();
  EXPECT_EQ(cancelled.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(busy.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the long call finished before the checks; size it up";
  ASSERT_TRUE(busy.get().ok());
  v1::ModelInfo info = Info(*stub, "d");
  EXPECT_EQ(info.accumulated_calls(), 0);  // neither ran
  EXPECT_EQ(info.next_seq_id(), 1u);       // seq_id 1 is still unused

  // Once executing, a request completes even if its client gives up, and
  // the retry gets its result.
  // With backward, a third of the samples still runs well past 500 ms.
  v1::ForwardBackwardRequest sequenced_long = long_call;
  sequenced_long.mutable_samples()->DeleteSubrange(
      0, 2 * long_call.samples_size() / 3);
  sequenced_long.set_forward_only(false);
  sequenced_long.set_seq_id(1);
  const auto gave_up = Send(&Stub::ForwardBackward, *stub, sequenced_long,
                            absl::Milliseconds(500));
  EXPECT_EQ(gave_up.status().code(), absl::StatusCode::kDeadlineExceeded);
  const auto replayed = Send(&Stub::ForwardBackward, *stub, sequenced_long);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_EQ(replayed->accumulated_calls(), 1);
  EXPECT_EQ(replayed->valid_tokens(),
            TokensOf({sequenced_long.samples().begin(),
                      sequenced_long.samples().end()}));
  info = Info(*stub, "d");
  EXPECT_EQ(info.accumulated_calls(), 1);
  EXPECT_EQ(info.next_seq_id(), 2u);
  EXPECT_EQ(Metric("tally_duplicate_requests_total", {{"model_id", "d"}}), 1);
}

TEST_F(ReliabilityE2eTest, AFullRequestBudgetRefusesAtOnce) {
  Stub* stub = Start({"--seq-gap-timeout-secs", "3", "--max-queued-requests",
                      "3", "--max-queued-requests-per-model", "2"});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "a");
  Create(*stub, "b");
  // Requests ahead of a gap hold their slots without using the CPU.
  auto held = [&](const std::string& model_id, uint64_t seq_id) {
    return std::async(std::launch::async, [this, model_id, seq_id] {
      std::unique_ptr<Stub> own = NewStub();
      return Send(&Stub::ForwardBackward, *own,
                  Fb(model_id, seq_id, Samples(seq_id)));
    });
  };
  auto await_depth = [&](double depth) {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (Metric("tally_queue_depth", {}) != depth && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(Metric("tally_queue_depth", {}), depth);
  };
  auto a5 = held("a", 5);
  auto a6 = held("a", 6);
  await_depth(2);
  absl::Time start = absl::Now();
  const auto per_model = Send(&Stub::GetModel, *stub, Get("a"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_EQ(per_model.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(per_model.status().message()),
              HasSubstr("--max-queued-requests-per-model"));
  auto b5 = held("b", 5);
  await_depth(3);
  start = absl::Now();
  const auto overall = Send(&Stub::GetModel, *stub, Get("b"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_EQ(overall.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(overall.status().message()),
              HasSubstr("--max-queued-requests)"));
  for (auto* waiting : {&a5, &a6, &b5}) {
    EXPECT_EQ(waiting->get().status().code(), absl::StatusCode::kAborted);
  }
  await_depth(0);
  EXPECT_EQ(Info(*stub, "a").accumulated_calls(), 0);
}

// The example of docs/reliability.md ("Back-pressure and retries"):
// --max-queued-requests-per-model 3, the executor busy; seq_ids 1-3 and then
// 4 sent with 0.3 s deadlines that pass while they wait. Their slots come back
// when the deadlines pass (not when their turn would come), so the retries get
// in, run once each, and the window is not poisoned by the gap timeout.
TEST_F(ReliabilityE2eTest, GivingUpUnderBackPressurePoisonsNoWindow) {
  Stub* stub = Start(
      {"--max-queued-requests-per-model", "3", "--seq-gap-timeout-secs", "4"});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "m");
  Create(*stub, "busy");
  const v1::ForwardBackwardRequest long_call = LongCall(*stub, "busy", 2.0);
  auto busy = std::async(std::launch::async, [&] {
    return Send(&Stub::ForwardBackward, *stub, long_call);
  });
  auto await_depth = [&](double depth) {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (Metric("tally_queue_depth", {}) != depth && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(Metric("tally_queue_depth", {}), depth);
  };
  await_depth(1);  // the long call holds the executor
  auto expiring = [&](uint64_t seq_id) {
    return std::async(std::launch::async, [this, seq_id] {
      std::unique_ptr<Stub> own = NewStub();
      return Send(&Stub::ForwardBackward, *own,
                  Fb("m", seq_id, Samples(seq_id)), absl::Milliseconds(300));
    });
  };
  std::vector<std::future<absl::StatusOr<v1::ForwardBackwardResponse>>> sent;
  for (uint64_t seq_id = 1; seq_id <= 3; ++seq_id) {
    sent.push_back(expiring(seq_id));
  }
  for (auto& call : sent) {
    EXPECT_EQ(call.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  }
  // Their slots are back while the long call still runs.
  await_depth(1);
  auto fourth = expiring(4);
  EXPECT_EQ(fourth.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  await_depth(1);
  EXPECT_EQ(busy.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the long call finished before the checks; size it up";

  // The retries, as the docs prescribe: each admitted at the first try.
  for (uint64_t seq_id = 1; seq_id <= 4; ++seq_id) {
    const auto retried =
        Send(&Stub::ForwardBackward, *stub, Fb("m", seq_id, Samples(seq_id)));
    ASSERT_TRUE(retried.ok())
        << "seq_id " << seq_id << ": " << retried.status();
    EXPECT_EQ(retried->accumulated_calls(), static_cast<int64_t>(seq_id));
  }
  ASSERT_TRUE(busy.get().ok());
  const auto stepped = Send(&Stub::OptimStep, *stub, Step("m", 5));
  ASSERT_TRUE(stepped.ok()) << stepped.status();  // the window is intact
  EXPECT_EQ(stepped->step(), 1);
  int64_t tokens = 0;
  for (uint64_t seq_id = 1; seq_id <= 4; ++seq_id) {
    tokens += TokensOf(Samples(seq_id));
  }
  EXPECT_EQ(stepped->normalizer(), tokens);  // each seq_id ran once
}

// A retry is answered with the bytes its first caller got: the cached
// response, parsed and sent again, serializes to the same bytes, however
// its metrics map is ordered in memory.
TEST_F(ReliabilityE2eTest, RetriesGetTheSameResponseBytes) {
  Stub* stub = Start({});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "bytes");
  TrainerClientOptions options;
  options.target = server_->grpc_target();
  grpc::GenericStub raw(TrainerClient::MakeChannel(options));
  const std::vector<
      std::pair<std::string, std::shared_ptr<google::protobuf::Message>>>
      calls = {
          {"ForwardBackward", std::make_shared<v1::ForwardBackwardRequest>(
                                  Fb("bytes", 1, Samples(1)))},
          {"ForwardBackward", std::make_shared<v1::ForwardBackwardRequest>(
                                  Fb("bytes", 2, Samples(2)))},
          {"OptimStep",
           std::make_shared<v1::OptimStepRequest>(Step("bytes", 3))},
      };
  constexpr int kRetries = 20;
  for (const auto& [method, request] : calls) {
    const absl::StatusOr<std::string> first = RawCall(raw, method, *request);
    ASSERT_TRUE(first.ok()) << method << ": " << first.status();
    // The responses carry maps of several entries: their order is what a
    // serialization could change.
    int metrics = 0;
    if (method == "OptimStep") {
      v1::OptimStepResponse response;
      ASSERT_TRUE(response.ParseFromString(*first));
      metrics = response.metrics_size();
    } else {
      v1::ForwardBackwardResponse response;
      ASSERT_TRUE(response.ParseFromString(*first));
      metrics = response.metrics_size();
    }
    EXPECT_GE(metrics, 3) << method;
    int different = 0;
    for (int i = 0; i < kRetries; ++i) {
      const absl::StatusOr<std::string> retry = RawCall(raw, method, *request);
      ASSERT_TRUE(retry.ok()) << method << ": " << retry.status();
      if (*retry != *first) ++different;
    }
    EXPECT_EQ(different, 0) << method << " (of " << kRetries << " retries)";
  }
  EXPECT_EQ(Metric("tally_duplicate_requests_total", {{"model_id", "bytes"}}),
            3 * kRetries);
}

TEST_F(ReliabilityE2eTest, SigtermDrainsWhileNotServingThenExitsZero) {
  Stub* stub = Start({"--shutdown-drain-secs", "2"});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "m");
  // The metrics port's probes: live and ready, then live and not ready.
  const int http = server_->metrics_port();
  EXPECT_EQ(HttpGet(http, "/healthz").value_or("?"), "ok\n");
  EXPECT_EQ(HttpGet(http, "/readyz").value_or("?"), "ok\n");
  const absl::Time sent = absl::Now();
  ASSERT_EQ(kill(server_->pid(), SIGTERM), 0);
  absl::SleepFor(absl::Milliseconds(500));
  const auto health = CheckHealth(server_->grpc_target());
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthCheckResponse::NOT_SERVING);
  const absl::StatusOr<std::string> ready = HttpGet(http, "/readyz");
  EXPECT_THAT(ready.status().message(), HasSubstr(" 503 "));
  EXPECT_THAT(ready.status().message(), HasSubstr("not ready: shutting down"));
  EXPECT_EQ(HttpGet(http, "/healthz").value_or("?"), "ok\n");
  // Still serving while the load balancer catches up.
  EXPECT_TRUE(Send(&Stub::GetModel, *stub, Get("m")).ok());
  stubs_.clear();
  const absl::StatusOr<int> exit_code = server_->Stop(kShutdownTimeout);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << server_->ReadLog();
  EXPECT_GE(absl::Now() - sent, absl::Seconds(2));
}

// A call whose response could exceed --max-message-bytes is refused before
// it runs: the window is unchanged, so the client's retry (or the same call
// without logprobs) applies it exactly once. Before, the call ran and then
// failed on its response, and an unsequenced retry added its gradients twice.
TEST_F(ReliabilityE2eTest, AResponseOverTheMessageLimitIsRefusedBeforeItRuns) {
  Stub* stub = Start({"--max-message-bytes", "65536"});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "m");
  // 150 samples of 60 tokens: a 40 KB request, a 72 KB logprob response.
  v1::ForwardBackwardRequest call = Fb("m", 0, Samples(31, 150, 60));
  call.set_return_logprobs(true);
  ASSERT_LT(call.ByteSizeLong(), 65536u);
  for (int attempt = 0; attempt < 2; ++attempt) {
    const auto refused = Send(&Stub::ForwardBackward, *stub, call);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
        << refused.status();
    // The reason tells every client that a retry cannot help.
    EXPECT_EQ(ReasonOf(refused.status()), ErrorReason::kMessageTooLarge);
    EXPECT_FALSE(IsRetryable(refused.status()));
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr("--max-message-bytes (65536)"));
    EXPECT_EQ(Info(*stub, "m").accumulated_calls(), 0) << attempt;
  }
  call.set_return_logprobs(false);
  const auto ran = Send(&Stub::ForwardBackward, *stub, call);
  ASSERT_TRUE(ran.ok()) << ran.status();
  EXPECT_EQ(Info(*stub, "m").accumulated_calls(), 1);
}

// A model "huge" of 3.5e13 parameters, each matrix within the config's own
// bounds: it fits no machine's --max-memory-bytes.
v1::CreateModelRequest HugeModel() {
  v1::CreateModelRequest huge;
  huge.set_model_id("huge");
  *huge.mutable_config() = testing::TinyModelConfig();
  huge.mutable_config()->set_hidden_size(int64_t{1} << 15);
  huge.mutable_config()->set_intermediate_size(int64_t{1} << 16);
  huge.mutable_config()->set_num_hidden_layers(4096);
  return huge;
}

// Memory admission: a CreateModel whose config would take more than
// --max-memory-bytes (3.5e13 parameters, or over a billion in FLOAT64 with
// the server's address space capped below them) is refused at once, before
// anything is allocated, and a call over --max-tokens-per-call too; a model
// admitted earlier keeps training. Before, the server tried to allocate it.
TEST_F(ReliabilityE2eTest, MemoryAdmissionRefusesWhatDoesNotFit) {
  // Like `prlimit --as`: 6 GiB of address space (an idle server maps about
  // 1.5), so a model the server tried to allocate would fail there, not be
  // refused by admission.
  constexpr uint64_t kAddressSpace = uint64_t{6} << 30;
  Stub* stub = Start(
      {"--max-memory-bytes", "200000000", "--max-tokens-per-call", "4096"},
      /*token=*/"", kAddressSpace);
  ASSERT_NE(stub, nullptr);
  Create(*stub, "m");
  // Over 10 GB of FLOAT64 parameters alone: more than the address space,
  // and little enough that this machine would otherwise try.
  v1::CreateModelRequest big = HugeModel();
  big.set_model_id("big");
  big.set_dtype(v1::DTYPE_FLOAT64);
  big.mutable_config()->set_hidden_size(4096);
  big.mutable_config()->set_intermediate_size(11008);
  big.mutable_config()->set_num_hidden_layers(8);
  for (const v1::CreateModelRequest& request : {HugeModel(), big}) {
    const absl::Time sent = absl::Now();
    const auto refused = Send(&Stub::CreateModel, *stub, request);
    EXPECT_LT(absl::Now() - sent, absl::Seconds(3));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
        << refused.status();
    EXPECT_EQ(ReasonOf(refused.status()), ErrorReason::kMemoryLimit);
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr("of --max-memory-bytes are left"));
    EXPECT_EQ(
        Send(&Stub::GetModel, *stub, Get(request.model_id())).status().code(),
        absl::StatusCode::kNotFound);
  }

  const auto long_call =
      Send(&Stub::ForwardBackward, *stub, Fb("m", 0, Samples(5, 80, 60)));
  EXPECT_EQ(long_call.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(long_call.status().message()),
              HasSubstr("--max-tokens-per-call (4096)"));

  ASSERT_TRUE(Send(&Stub::ForwardBackward, *stub, Fb("m", 0, Samples(6))).ok());
  ASSERT_TRUE(Send(&Stub::OptimStep, *stub, Step("m", 0)).ok());
  EXPECT_EQ(Info(*stub, "m").step(), 1);

  // What the dashboard's memory panels show.
  EXPECT_EQ(Metric("tally_memory_limit_bytes", {{"scope", "server"}}), 2e8);
  EXPECT_EQ(Metric("tally_memory_limit_bytes", {{"scope", "tenant"}}), 0);
  const double admitted = Metric("tally_memory_admitted_bytes", {});
  EXPECT_GT(admitted, 0);
  EXPECT_LT(admitted, 2e8);
  EXPECT_EQ(Metric("tally_memory_refusals_total", {{"refused", "model"}}), 2);
}

// LoRA adapters on one base: the ledger charges the base once, with the
// first adapter, and frees it with the last; each adapter costs its own
// state only. Adapters of one base share it (ModelInfo.base) and train
// independently.
TEST_F(ReliabilityE2eTest, LoraAdaptersChargeTheirSharedBaseOnce) {
  Stub* stub = Start({"--max-memory-bytes", "200000000"});
  ASSERT_NE(stub, nullptr);
  auto adapter = [&](const std::string& model_id) {
    v1::CreateModelRequest request;
    request.set_model_id(model_id);
    *request.mutable_config() = testing::TinyModelConfig();
    request.set_seed(3);
    request.set_dtype(v1::DTYPE_FLOAT64);
    request.mutable_lora()->set_rank(2);
    const auto created = Send(&Stub::CreateModel, *stub, request);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.value_or(v1::ModelInfo());
  };
  auto admitted = [&] { return Metric("tally_memory_admitted_bytes", {}); };
  const v1::ModelInfo a = adapter("a");
  const double with_a = admitted();
  const v1::ModelInfo b = adapter("b");
  const double with_b = admitted();
  EXPECT_EQ(a.lora().rank(), 2);
  EXPECT_EQ(a.lora().alpha(), 32);
  EXPECT_FALSE(a.base().empty());
  EXPECT_EQ(a.base(), b.base());
  EXPECT_GT(a.trainable_parameters(), 0u);
  EXPECT_LT(a.trainable_parameters(), a.num_parameters());
  // "b" brought its adapter only; "a" brought the base as well.
  const double per_adapter = with_b - with_a;
  EXPECT_GT(per_adapter, 0);
  EXPECT_GT(with_a, per_adapter + 8.0 * a.num_parameters() * 0.9);

  ASSERT_TRUE(Send(&Stub::ForwardBackward, *stub, Fb("a", 0, Samples(6))).ok());
  ASSERT_TRUE(Send(&Stub::OptimStep, *stub, Step("a", 0)).ok());
  EXPECT_EQ(Info(*stub, "a").step(), 1);
  EXPECT_EQ(Info(*stub, "b").step(), 0);

  v1::DeleteModelRequest remove;
  remove.set_model_id("a");
  ASSERT_TRUE(Send(&Stub::DeleteModel, *stub, remove).ok());
  EXPECT_EQ(admitted(), with_b - per_adapter);  // the base stays for "b"
  remove.set_model_id("b");
  ASSERT_TRUE(Send(&Stub::DeleteModel, *stub, remove).ok());
  EXPECT_EQ(admitted(), 0);
}

// An adapter is charged for the base it is built on. A model exported over a
// base's directory makes the next adapter over that path another base, read
// and charged from the new contents, while the adapters on the first keep
// theirs. Before, it was built on the first (large) base still in memory but
// charged from the small config.json on disk.
TEST_F(ReliabilityE2eTest, AnAdapterIsChargedForTheBaseItIsBuiltOn) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/export-over-", getpid());
  const absl::Cleanup remove_dir = [&dir] {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  };
  Stub* stub = Start({"--max-memory-bytes", "200000000"});
  ASSERT_NE(stub, nullptr);
  auto create = [&](const std::string& model_id, int32_t hidden,
                    const std::string& init_checkpoint) {
    v1::CreateModelRequest request;
    request.set_model_id(model_id);
    request.set_dtype(v1::DTYPE_FLOAT32);
    if (init_checkpoint.empty()) {
      *request.mutable_config() = testing::TinyModelConfig();
      request.mutable_config()->set_hidden_size(hidden);
      request.mutable_config()->set_intermediate_size(2 * hidden);
    } else {
      request.set_init_checkpoint(init_checkpoint);
      request.mutable_lora()->set_rank(8);
    }
    const auto created = Send(&Stub::CreateModel, *stub, request);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.value_or(v1::ModelInfo());
  };
  auto export_to = [&](const std::string& model_id, const std::string& path) {
    v1::ExportWeightsRequest request;
    request.set_model_id(model_id);
    request.set_path(path);
    const auto exported = Send(&Stub::ExportWeights, *stub, request);
    EXPECT_TRUE(exported.ok()) << exported.status();
  };
  auto admitted = [&] { return Metric("tally_memory_admitted_bytes", {}); };
  const std::string base = dir + "/b";
  create("big", 256, "");
  const v1::ModelInfo tiny = create("tiny", testing::kTinyHidden, "");
  export_to("big", base);
  const double full_models = admitted();
  const v1::ModelInfo first = create("first", 0, base);
  const double with_first = admitted();
  export_to("tiny", base);
  const v1::ModelInfo second = create("second", 0, base);
  const double with_second = admitted();
  EXPECT_NE(second.base(), first.base());
  EXPECT_EQ(second.num_parameters(), tiny.num_parameters());
  EXPECT_LT(second.trainable_bytes(), first.trainable_bytes());
  // Its own state (weights, gradients, AdamW's two moments) and, as the
  // first adapter on its base, the base's float32 weights.
  EXPECT_GE(with_second - with_first,
            4.0 * second.trainable_bytes() + 4.0 * 0.9 * tiny.num_parameters());
  // Another adapter over the unchanged directory shares the new base.
  const v1::ModelInfo third = create("third", 0, base);
  EXPECT_EQ(third.base(), second.base());
  EXPECT_NEAR(admitted() - with_second, 4.0 * third.trainable_bytes(), 1.0);
  EXPECT_GE(with_first - full_models,
            4.0 * first.trainable_bytes() + 4.0 * 0.9 * first.num_parameters());
  for (const char* model_id : {"first", "second", "third"}) {
    v1::DeleteModelRequest remove;
    remove.set_model_id(model_id);
    ASSERT_TRUE(Send(&Stub::DeleteModel, *stub, remove).ok()) << model_id;
  }
  EXPECT_NEAR(admitted(), full_models, 1.0);
}

// A drain that would use up the whole exit budget is refused at start,
// naming both flags: it could only ever end in the watchdog's exit 1.
TEST_F(ReliabilityE2eTest, ADrainAsLongAsTheExitTimeoutIsRefusedAtStart) {
  const absl::StatusOr<std::unique_ptr<ServerProcess>> refused =
      ServerProcess::Start(
          testing::ServerBinaryFromEnv(),
          {"--shutdown-drain-secs", "5", "--exit-timeout-secs", "5"});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("--shutdown-drain-secs (5) must be less than "
                        "--exit-timeout-secs (5)"));
}

// A client that stays connected (an idle channel that has sent requests)
// does not hold gRPC's shutdown back past the exit timeout.
TEST_F(ReliabilityE2eTest, AnIdleConnectedClientDoesNotHoldTheExitBack) {
  Stub* stub =
      Start({"--shutdown-drain-secs", "1", "--exit-timeout-secs", "4"});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "m");
  ASSERT_TRUE(Send(&Stub::GetModel, *stub, Get("m")).ok());
  const absl::Time sent = absl::Now();
  // The stub and its channel stay open through the shutdown.
  const absl::StatusOr<int> exit_code = server_->Stop(kShutdownTimeout);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << server_->ReadLog();
  EXPECT_LT(absl::Now() - sent, absl::Seconds(4));
}

TEST_F(ReliabilityE2eTest, SigtermFinishesTheExecutingCallAndRefusesQueued) {
  Stub* stub = Start({});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "m");
  const v1::ForwardBackwardRequest long_call = LongCall(*stub, "m", 2.0);
  auto executing = std::async(std::launch::async, [&] {
    return Send(&Stub::ForwardBackward, *stub, long_call);
  });
  absl::SleepFor(absl::Milliseconds(300));
  auto queued = std::async(std::launch::async, [&] {
    return Send(&Stub::ForwardBackward, *stub, Fb("m", 1, Samples(1)));
  });
  absl::SleepFor(absl::Milliseconds(200));
  ASSERT_EQ(executing.wait_for(std::chrono::seconds(0)),
            std::future_status::timeout)
      << "the long call finished before SIGTERM";
  const absl::StatusOr<int> exit_code = server_->Stop(kShutdownTimeout);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << server_->ReadLog();
  const auto finished = executing.get();
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_EQ(finished->samples_size(), long_call.samples_size());
  const auto refused = queued.get();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable)
      << refused.status();
}

TEST_F(ReliabilityE2eTest, AShutdownOverrunningTheExitTimeoutExitsOne) {
  Stub* stub = Start({"--exit-timeout-secs", "1"});
  ASSERT_NE(stub, nullptr);
  Create(*stub, "m");
  const v1::ForwardBackwardRequest long_call = LongCall(*stub, "m", 5.0);
  auto executing = std::async(std::launch::async, [&] {
    return Send(&Stub::ForwardBackward, *stub, long_call);
  });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time sent = absl::Now();
  const absl::StatusOr<int> exit_code = server_->Stop(kShutdownTimeout);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 1) << server_->ReadLog();
  EXPECT_LT(absl::Now() - sent, absl::Seconds(4));
  EXPECT_THAT(server_->ReadLog(), HasSubstr("--exit-timeout-secs"));
  EXPECT_FALSE(executing.get().ok());
  // Exiting 1 was the point: not a failure for TearDown.
  stubs_.clear();
  servers_.clear();
}

// The request every hostile thread may send, with the codes it may get.
struct Hostile {
  std::string what;
  std::function<absl::Status(Stub&)> send;
  std::set<absl::StatusCode> allowed;
};

// Eight threads send a shuffled, retried, partly cancelled stream of valid
// sequenced requests for tenant alice's model "h", mixed with malformed,
// oversized, unknown-model, conflicting, over-budget and other tenants'
// requests, and create, call and delete models of their own. Every reply
// carries a documented code, and "h" ends where one clean client sending only
// the valid requests puts model "clean".
TEST_F(ReliabilityE2eTest, HostileClientsLeaveTheModelWhereACleanRunDoes) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/hostile-", getpid());
  std::filesystem::create_directories(dir + "/root");
  const absl::Cleanup remove_dir = [&dir] {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  };
  std::ofstream(dir + "/tokens") << "alice-token alice\nbob-token bob\n";
  Stub* stub = Start({"--max-message-bytes", "65536", "--auth-tokens-file",
                      dir + "/tokens", "--checkpoint-root", dir + "/root"},
                     "alice-token");
  ASSERT_NE(stub, nullptr);
  // Shared by the threads (stubs are thread-safe): another tenant, and a
  // client without a token.
  const std::unique_ptr<Stub> bob = NewStub("bob-token");
  const std::unique_ptr<Stub> anonymous = NewStub("");
  Create(*stub, "h");
  Create(*stub, "clean");

  // The valid stream: windows of 3 calls, then a step.
  constexpr int kSteps = 5;
  std::vector<std::function<absl::Status(Stub&, const std::string&, uint64_t,
                                         absl::Duration)>>
      valid;
  for (int step = 0; step < kSteps; ++step) {
    for (int call = 0; call < 3; ++call) {
      const uint64_t seed = 100 * step + call;
      valid.push_back([seed](Stub& s, const std::string& model_id,
                             uint64_t seq_id, absl::Duration deadline) {
        return Send(&Stub::ForwardBackward, s,
                    Fb(model_id, seq_id, Samples(seed, 1 + seed % 3)), deadline)
            .status();
      });
    }
    valid.push_back([](Stub& s, const std::string& model_id, uint64_t seq_id,
                       absl::Duration deadline) {
      return Send(&Stub::OptimStep, s, Step(model_id, seq_id), deadline)
          .status();
    });
  }
  for (size_t i = 0; i < valid.size(); ++i) {
    ASSERT_TRUE(valid[i](*stub, "clean", 0, kCallDeadline).ok()) << i;
  }

  const std::set<absl::StatusCode> invalid = {
      absl::StatusCode::kInvalidArgument};
  std::vector<Hostile> hostile = {
      {"bad model id",
       [](Stub& s) {
         return Send(&Stub::ForwardBackward, s, Fb("bad id!", 1, Samples(1)))
             .status();
       },
       invalid},
      {"no samples",
       [](Stub& s) {
         return Send(&Stub::ForwardBackward, s, Fb("h", 2, {})).status();
       },
       invalid},
      {"token outside the vocabulary",
       [](Stub& s) {
         std::vector<v1::Sample> samples = Samples(5);
         samples[0].set_input_tokens(0, kTinyVocab + 7);
         return Send(&Stub::ForwardBackward, s, Fb("h", 0, samples)).status();
       },
       invalid},
      {"lengths differ",
       [](Stub& s) {
         std::vector<v1::Sample> samples = Samples(6);
         samples[0].add_target_tokens(1);
         // Checked by the engine, where a sequenced request would be final:
         // unsequenced, like the other engine-level rejections here.
         return Send(&Stub::ForwardBackward, s, Fb("h", 0, samples)).status();
       },
       invalid},
      {"unknown reduction",
       [](Stub& s) {
         v1::ForwardBackwardRequest request = Fb("h", 4, Samples(7));
         request.set_reduction(static_cast<v1::LossReduction>(42));
         return Send(&Stub::ForwardBackward, s, request).status();
       },
       invalid},
      {"negative learning rate",
       [](Stub& s) {
         v1::OptimStepRequest request = Step("h", 0);
         request.mutable_adam()->set_learning_rate(-1);
         return Send(&Stub::OptimStep, s, request).status();
       },
       invalid},
      {"oversized",
       [](Stub& s) {
         return Send(&Stub::ForwardBackward, s,
                     Fb("h", 5, Samples(8, 1000, testing::kTinyMaxPositions)))
             .status();
       },
       {absl::StatusCode::kResourceExhausted}},
      {"unknown model",
       [](Stub& s) {
         return Send(&Stub::ForwardBackward, s, Fb("ghost", 1, Samples(9)))
             .status();
       },
       {absl::StatusCode::kNotFound}},
      // Unsequenced, on the trained model: refused before it runs, it must
      // leave "h" exactly where the clean run is.
      {"response over the message limit",
       [](Stub& s) {
         v1::ForwardBackwardRequest call = Fb("h", 0, Samples(31, 150, 60));
         call.set_return_logprobs(true);
         return Send(&Stub::ForwardBackward, s, call).status();
       },
       {absl::StatusCode::kResourceExhausted}},
      {"another tenant reads it",
       [&bob](Stub&) { return Send(&Stub::GetModel, *bob, Get("h")).status(); },
       {absl::StatusCode::kNotFound}},
      {"another tenant steps it",
       [&bob](Stub&) {
         return Send(&Stub::OptimStep, *bob, Step("h", 0)).status();
       },
       {absl::StatusCode::kNotFound}},
      {"no token",
       [&anonymous](Stub&) {
         return Send(&Stub::ForwardBackward, *anonymous,
                     Fb("h", 0, Samples(12)))
             .status();
       },
       {absl::StatusCode::kUnauthenticated}},
      {"a checkpoint path out of the tenant's root",
       [](Stub& s) {
         v1::SaveCheckpointRequest save;
         save.set_model_id("h");
         save.set_path("../bob/stolen");
         save.set_allow_pending(true);
         return Send(&Stub::SaveCheckpoint, s, save).status();
       },
       {absl::StatusCode::kPermissionDenied}},
      {"a model over the memory budget",
       [](Stub& s) {
         return Send(&Stub::CreateModel, s, HugeModel()).status();
       },
       {absl::StatusCode::kResourceExhausted}},
      // Each thread churns a model of its own: created, sent pipelined
      // sequenced calls and deleted while they wait behind each other, then
      // re-created. Calls of a deleted incarnation are answered once
      // (NOT_FOUND) and never run on the next one.
      {"churn: create, pipelined calls, delete",
       [](Stub& s) {
         static std::atomic<int> churners{0};
         thread_local const std::string own_id =
             absl::StrCat("churn-", churners++);
         const std::string id = own_id;  // for the call threads too
         v1::CreateModelRequest create;
         create.set_model_id(id);
         *create.mutable_config() = testing::TinyModelConfig();
         create.set_dtype(v1::DTYPE_FLOAT64);
         absl::Status status = Send(&Stub::CreateModel, s, create).status();
         if (!status.ok() && !absl::IsAlreadyExists(status)) return status;
         std::vector<std::future<absl::Status>> calls;
         for (uint64_t seq_id = 1; seq_id <= 3; ++seq_id) {
           calls.push_back(std::async(std::launch::async, [&s, id, seq_id] {
             return Send(&Stub::ForwardBackward, s,
                         Fb(id, seq_id, Samples(seq_id)))
                 .status();
           }));
         }
         v1::DeleteModelRequest remove;
         remove.set_model_id(id);
         status = Send(&Stub::DeleteModel, s, remove).status();
         for (auto& call : calls) {
           const absl::Status answered = call.get();
           if (!answered.ok() && status.ok()) status = answered;
         }
         return status;
       },
       {absl::StatusCode::kOk, absl::StatusCode::kNotFound}},
  };

  // Each thread sends its share of the valid stream in ascending seq_id
  // order (so some thread always holds the next one), each valid request
  // exactly once with a long deadline, plus copies with short deadlines or
  // cancelled, a conflicting payload under a seq_id it saw succeed, and
  // hostile requests.
  constexpr int kThreads = 8;
  std::vector<std::vector<uint64_t>> shares(kThreads);
  std::mt19937 rng(2024);
  for (uint64_t seq_id = 1; seq_id <= valid.size(); ++seq_id) {
    shares[rng() % kThreads].push_back(seq_id);
  }
  std::mutex failures_mu;
  std::vector<std::string> failures;
  auto expect = [&](bool ok, const std::string& what, const absl::Status& s) {
    if (ok) return;
    std::lock_guard<std::mutex> lock(failures_mu);
    failures.push_back(absl::StrCat(what, ": ", s.ToString()));
  };
  std::atomic<int> sent{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<Stub> own = NewStub();
      std::mt19937 thread_rng(t);
      for (uint64_t seq_id : shares[t]) {
        for (int noise = thread_rng() % 4; noise > 0; --noise) {
          const Hostile& h = hostile[thread_rng() % hostile.size()];
          const absl::Status status = h.send(*own);
          expect(h.allowed.count(status.code()) > 0, h.what, status);
          ++sent;
        }
        const auto& request = valid[seq_id - 1];
        if (thread_rng() % 2 == 0) {
          // A copy that gives up early: it ran (OK) or it did not.
          const absl::Status copy =
              request(*own, "h", seq_id, absl::Milliseconds(thread_rng() % 50));
          expect(copy.ok() || absl::IsDeadlineExceeded(copy), "short copy",
                 copy);
          ++sent;
        }
        const absl::Status status = request(*own, "h", seq_id, kCallDeadline);
        expect(status.ok(), absl::StrCat("valid seq_id ", seq_id), status);
        const absl::Status retry = request(*own, "h", seq_id, kCallDeadline);
        expect(retry.ok(), absl::StrCat("retried seq_id ", seq_id), retry);
        const absl::Status conflict =
            Send(&Stub::ForwardBackward, *own, Fb("h", seq_id, Samples(999)))
                .status();
        expect(absl::IsAlreadyExists(conflict),
               absl::StrCat("conflict at seq_id ", seq_id), conflict);
        sent += 3;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(failures, ::testing::IsEmpty());
  EXPECT_GT(sent.load(), static_cast<int>(3 * valid.size()));

  const v1::ModelInfo h = Info(*stub, "h");
  const v1::ModelInfo clean = Info(*stub, "clean");
  EXPECT_EQ(h.step(), kSteps);
  EXPECT_EQ(h.step(), clean.step());
  EXPECT_EQ(h.accumulated_calls(), 0);
  EXPECT_EQ(h.next_seq_id(), valid.size() + 1);
  EXPECT_EQ(ProbeLoss(*stub, "h"), ProbeLoss(*stub, "clean"));
  const auto health = CheckHealth(server_->grpc_target());
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthCheckResponse::SERVING);
}

// 32 clients over 8 models: each model's four clients send one call of each
// window (sequenced, in turn) and client 0 steps it. Every response matches
// what the samples hold, the identically fed models end identical, and the
// server holds nothing afterwards.
TEST_F(ReliabilityE2eTest, SoakOf32ClientsOver8Models) {
  Stub* stub = Start({});
  ASSERT_NE(stub, nullptr);
  constexpr int kModels = 8;
  constexpr int kClientsPerModel = 4;
  constexpr int kSteps = 3;
  constexpr uint64_t kSeqPerStep = kClientsPerModel + 1;
  for (int m = 0; m < kModels; ++m) Create(*stub, absl::StrCat("soak-", m));
  const auto rss_kib = [&] {
    std::ifstream status(absl::StrCat("/proc/", server_->pid(), "/status"));
    std::string line;
    int64_t kib = 0;
    while (std::getline(status, line)) {
      if (line.rfind("VmRSS:", 0) == 0) {
        absl::SimpleAtoi(line.substr(6, line.size() - 6 - 3), &kib);
      }
    }
    return kib;
  };
  const int64_t rss_before = rss_kib();

  std::mutex failures_mu;
  std::vector<std::string> failures;
  auto fail = [&](const std::string& what) {
    std::lock_guard<std::mutex> lock(failures_mu);
    failures.push_back(what);
  };
  std::vector<std::thread> clients;
  for (int m = 0; m < kModels; ++m) {
    for (int c = 0; c < kClientsPerModel; ++c) {
      clients.emplace_back([&, m, c] {
        const std::string model_id = absl::StrCat("soak-", m);
        std::unique_ptr<Stub> own = NewStub();
        for (int step = 0; step < kSteps; ++step) {
          const uint64_t base = step * kSeqPerStep;
          const std::vector<v1::Sample> samples = Samples(10 * step + c);
          const auto fb = Send(&Stub::ForwardBackward, *own,
                               Fb(model_id, base + c + 1, samples));
          if (!fb.ok() || fb->valid_tokens() != TokensOf(samples) ||
              fb->accumulated_calls() != c + 1) {
            fail(absl::StrCat(
                model_id, " call ", step, "/", c, ": ",
                fb.ok() ? fb->DebugString() : fb.status().ToString()));
          }
          if (c != 0) continue;
          const auto stepped =
              Send(&Stub::OptimStep, *own, Step(model_id, base + kSeqPerStep));
          int64_t window_tokens = 0;
          for (int k = 0; k < kClientsPerModel; ++k) {
            window_tokens += TokensOf(Samples(10 * step + k));
          }
          if (!stepped.ok() || stepped->step() != step + 1 ||
              stepped->normalizer() != window_tokens) {
            fail(absl::StrCat(model_id, " step ", step, ": ",
                              stepped.ok() ? stepped->DebugString()
                                           : stepped.status().ToString()));
          }
        }
      });
    }
  }
  for (std::thread& client : clients) client.join();
  EXPECT_THAT(failures, ::testing::IsEmpty());

  const double reference = ProbeLoss(*stub, "soak-0");
  for (int m = 0; m < kModels; ++m) {
    const std::string model_id = absl::StrCat("soak-", m);
    const v1::ModelInfo info = Info(*stub, model_id);
    EXPECT_EQ(info.step(), kSteps) << model_id;
    EXPECT_EQ(info.next_seq_id(), kSteps * kSeqPerStep + 1) << model_id;
    EXPECT_EQ(ProbeLoss(*stub, model_id), reference) << model_id;
  }
  EXPECT_EQ(Metric("tally_queue_depth", {}), 0);
  // Cached responses and gRPC buffers, not a leak: generously bounded.
  EXPECT_LT(rss_kib() - rss_before, 256 * 1024);
}

}  // namespace
}  // namespace tally
