// ServerMetrics' rank state, scraped over HTTP from a single-rank engine: the
// shard sizes against the model's own tensors, the collective counters
// against the communicator's CommStats, and the series of a deleted model
// gone.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "gtest/gtest.h"
#include "server/metrics.h"
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

int64_t Bytes(CausalLm& model, bool gradients) {
  int64_t total = 0;
  for (const Parameter& p : model.parameters()) {
    const torch::Tensor& t = gradients ? p.tensor.grad() : p.tensor;
    if (t.defined()) total += t.numel() * t.element_size();
  }
  return total;
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

  CausalLm* model = *e.model("m");
  const int64_t parameter_bytes = Bytes(*model, false);
  std::string text = Scrape(port);
  EXPECT_EQ(Value(text, "tally_models{rank=\"0\"}"), 1);
  EXPECT_EQ(Value(text, "tally_world_size{rank=\"0\"}"), 1);
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

}  // namespace
}  // namespace tally
