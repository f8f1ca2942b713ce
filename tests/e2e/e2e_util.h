// Helpers shared by the end-to-end tests (header-only: tests/e2e/*_test.cc
// each build into their own binary).
#ifndef TALLY_TESTS_E2E_E2E_UTIL_H_
#define TALLY_TESTS_E2E_E2E_UTIL_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/trainer_client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"
#include "tally/v1/trainer.pb.h"
#include "tests/e2e/server_process.h"

// ASSERTs that `expr` (an absl::StatusOr) is OK, then moves its value into
// `lhs`.
#define TALLY_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  TALLY_ASSERT_OK_AND_ASSIGN_IMPL_(           \
      TALLY_E2E_CONCAT_(tally_assert_statusor_, __LINE__), lhs, expr)
#define TALLY_E2E_CONCAT_(a, b) TALLY_E2E_CONCAT_INNER_(a, b)
#define TALLY_E2E_CONCAT_INNER_(a, b) a##b
#define TALLY_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                     \
  ASSERT_TRUE(statusor.ok()) << statusor.status();            \
  lhs = std::move(statusor).value()

namespace tally::testing {

inline constexpr int32_t kIgnoredTarget = -100;

// What the proto calls valid: a real target and a positive weight.
inline int64_t ValidTokens(const v1::Sample& sample) {
  int64_t valid = 0;
  for (int i = 0; i < sample.target_tokens_size(); ++i) {
    const bool weighted = sample.weights_size() == 0 || sample.weights(i) != 0;
    if (sample.target_tokens(i) != kIgnoredTarget && weighted) ++valid;
  }
  return valid;
}

// `length` random next-token positions over `vocab` tokens: the first
// `masked` targets are kIgnoredTarget, and position i weighs `weight(i)` when
// a weight function is given (called in order, after the tokens are drawn).
inline v1::Sample MakeSample(std::mt19937& rng, int32_t vocab, int length,
                             int masked,
                             const std::function<float(int)>& weight = {}) {
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  std::vector<int32_t> text(length + 1);
  for (int32_t& t : text) t = token(rng);
  v1::Sample sample;
  for (int i = 0; i < length; ++i) {
    sample.add_input_tokens(text[i]);
    sample.add_target_tokens(i < masked ? kIgnoredTarget : text[i + 1]);
    if (weight) sample.add_weights(weight(i));
  }
  return sample;
}

// The checkpoint tests' training window of step `step`: two calls of random
// samples drawn from the step number, so a resumed run sends exactly what an
// uninterrupted one sent.
inline std::vector<v1::ForwardBackwardRequest> StepWindow(
    const std::string& model_id, int step, int32_t vocab) {
  std::mt19937 rng(1000 + step);
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  std::vector<v1::ForwardBackwardRequest> calls(2);
  for (v1::ForwardBackwardRequest& call : calls) {
    call.set_model_id(model_id);
    for (int s = 0; s < 2; ++s) {
      v1::Sample* sample = call.add_samples();
      for (int i = 0; i < 6 + 3 * s; ++i) {
        sample->add_input_tokens(token(rng));
        sample->add_target_tokens(token(rng));
      }
    }
  }
  return calls;
}

// Trains steps first..last (inclusive) of StepWindow, checking each reaches
// its step. With `seq_id`, every call is sequenced, continuing *seq_id.
inline void Train(TrainerClient& client, const std::string& model_id,
                  int32_t vocab, int first, int last,
                  uint64_t* seq_id = nullptr) {
  for (int step = first; step <= last; ++step) {
    for (v1::ForwardBackwardRequest call : StepWindow(model_id, step, vocab)) {
      if (seq_id != nullptr) call.set_seq_id(++*seq_id);
      const absl::StatusOr<v1::ForwardBackwardResponse> done =
          client.ForwardBackward(call);
      ASSERT_TRUE(done.ok()) << done.status();
    }
    v1::OptimStepRequest optim;
    optim.set_model_id(model_id);
    if (seq_id != nullptr) optim.set_seq_id(++*seq_id);
    const absl::StatusOr<v1::OptimStepResponse> stepped =
        client.OptimStep(optim);
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    ASSERT_EQ(stepped->step(), step);
  }
}

// `command` run by the shell with stderr joined to stdout: its exit status
// (-1 when it did not exit) and output.
inline std::pair<int, std::string> RunCommand(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) {
    output.append(buffer, n);
  }
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

// The whole file; empty when it cannot be read.
inline std::string ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The tiny Llama the e2e tests train: 19,616 parameters.
inline constexpr int32_t kTinyVocab = 64;
inline constexpr int32_t kTinyHidden = 32;
inline constexpr int32_t kTinyIntermediate = 48;
inline constexpr int32_t kTinyLayers = 2;
inline constexpr int32_t kTinyHeads = 4;
inline constexpr int32_t kTinyKvHeads = 2;
inline constexpr int32_t kTinyMaxPositions = 64;

inline v1::ModelConfig TinyModelConfig() {
  v1::ModelConfig config;
  config.set_vocab_size(kTinyVocab);
  config.set_hidden_size(kTinyHidden);
  config.set_intermediate_size(kTinyIntermediate);
  config.set_num_hidden_layers(kTinyLayers);
  config.set_num_attention_heads(kTinyHeads);
  config.set_num_key_value_heads(kTinyKvHeads);
  config.set_max_position_embeddings(kTinyMaxPositions);
  return config;
}

// The server's grpc.health.v1 status (overall service).
inline absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
CheckHealth(const std::string& target,
            absl::Duration timeout = absl::Seconds(10)) {
  TrainerClientOptions options;
  options.target = target;
  auto stub =
      grpc::health::v1::Health::NewStub(TrainerClient::MakeChannel(options));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status =
      stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.status();
}

// The body of `GET path` from 127.0.0.1:port over HTTP/1.0 (the server
// closes the connection after the response); an error unless it is a 200.
// `headers`: extra "Name: value\r\n" lines.
inline absl::StatusOr<std::string> HttpGet(int port, const std::string& path,
                                           const std::string& headers = "") {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket");
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  const timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address),
              sizeof address) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("connect 127.0.0.1:", port));
  }
  const std::string request = absl::StrCat(
      "GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n", headers, "\r\n");
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n =
        send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, "send");
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buffer[16384];
  while (true) {
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, "recv");
    if (n == 0) break;
    response.append(buffer, static_cast<size_t>(n));
  }
  const size_t header_end = response.find("\r\n\r\n");
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (header_end == std::string::npos ||
      status_line.find(" 200 ") == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("GET ", path, " from port ",
                                               port, " answered: '",
                                               response.substr(0, 200), "'"));
  }
  return response.substr(header_end + 4);
}

// The value of the sample of metric `name` whose labels include every pair in
// `labels`, read from Prometheus text exposition. Label values must hold no
// ',' or '}', which is true of tally's (model ids, RPC names, codes).
inline absl::StatusOr<double> MetricValue(
    const std::string& exposition, const std::string& name,
    const std::map<std::string, std::string>& labels) {
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (line.empty() || line.front() == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    if (name_end == absl::string_view::npos ||
        line.substr(0, name_end) != name) {
      continue;
    }
    absl::string_view rest = line.substr(name_end);
    std::map<std::string, std::string> found;
    if (rest.front() == '{') {
      const size_t close = rest.find('}');
      if (close == absl::string_view::npos) continue;
      for (absl::string_view pair :
           absl::StrSplit(rest.substr(1, close - 1), ',', absl::SkipEmpty())) {
        const size_t equals = pair.find('=');
        if (equals == absl::string_view::npos) continue;
        absl::string_view value = pair.substr(equals + 1);
        absl::ConsumePrefix(&value, "\"");
        absl::ConsumeSuffix(&value, "\"");
        found[std::string(pair.substr(0, equals))] = std::string(value);
      }
      rest = rest.substr(close + 1);
    }
    const bool matches =
        std::all_of(labels.begin(), labels.end(), [&](const auto& label) {
          auto it = found.find(label.first);
          return it != found.end() && it->second == label.second;
        });
    if (!matches) continue;
    double value = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(rest), &value)) {
      return absl::DataLossError(
          absl::StrCat("unparsable sample line '", line, "'"));
    }
    return value;
  }
  std::string wanted = name;
  for (const auto& [key, value] : labels) {
    absl::StrAppend(&wanted, " ", key, "=", value);
  }
  return absl::NotFoundError(absl::StrCat("no sample ", wanted));
}

// Starts the server under test with `args` and adds it to `servers`; nullptr,
// with the failure recorded, when it does not come up.
inline ServerProcess* StartServerOrFail(
    const std::vector<std::string>& args,
    std::vector<std::unique_ptr<ServerProcess>>& servers,
    uint64_t address_space_bytes = 0) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> started = ServerProcess::Start(
      ServerBinaryFromEnv(), args, absl::Seconds(60), address_space_bytes);
  if (!started.ok()) {
    ADD_FAILURE() << started.status();
    return nullptr;
  }
  servers.push_back(*std::move(started));
  return servers.back().get();
}

// SIGTERMs every server and expects each to exit 0 within `timeout`.
inline void ExpectCleanShutdown(
    const std::vector<std::unique_ptr<ServerProcess>>& servers,
    absl::Duration timeout) {
  for (const std::unique_ptr<ServerProcess>& server : servers) {
    const absl::StatusOr<int> exit_code = server->Stop(timeout);
    EXPECT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(exit_code.value_or(-1), 0) << server->ReadLog();
  }
}

}  // namespace tally::testing

#endif  // TALLY_TESTS_E2E_E2E_UTIL_H_
