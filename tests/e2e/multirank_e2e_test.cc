// End-to-end test of a multi-rank tally-server: `--nproc-per-node 4
// --dp-shard 2 --tp 2` driven by the C++ client answers the same requests as
// a 1-rank server (losses, token counts, gradient norms, checkpoints, and a
// checkpoint loaded on the other mesh continues the same trajectory), and its
// launcher exits non-zero, naming the rank, when a rank process dies or hangs
// (rank 0 answering UNAVAILABLE within --collective-timeout-secs).
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <sstream>
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
#include "base/status.h"
#include "client/trainer_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/server_process.h"

namespace tally {
namespace {

using ::tally::testing::MakeSample;
using ::tally::testing::ServerBinaryFromEnv;
using ::tally::testing::ServerProcess;
using ::tally::testing::TinyModelConfig;
using ::tally::testing::ValidTokens;
using ::testing::HasSubstr;

constexpr int32_t kVocab = ::tally::testing::kTinyVocab;
constexpr double kMaxGradNorm = 1.0;
// AdamW's update lr * g / (|g| + eps) is ill-conditioned where |g| is near
// eps: with the default eps 1e-8, float32 rounding of a gradient element
// (2e-11 apart, as the meshes sum in different orders) moved a weight by
// 5.7e-6, 7.5e-5 of its tensor's largest magnitude, in one step. With eps
// 1e-6 that amplification is at most lr * 2e-11 / eps = 2e-8.
constexpr double kAdamEps = 1e-6;
// FLOAT32 results of different meshes sum in different orders.
constexpr double kFloat32Tolerance = 1e-5;
constexpr char kModelId[] = "tiny";
constexpr absl::Duration kShutdownTimeout = absl::Seconds(30);

const std::vector<std::string>& DpShardTpFlags() {
  static const auto* flags = new std::vector<std::string>{
      "--nproc-per-node", "4", "--dp-shard", "2", "--tp", "2"};
  return *flags;
}

// The tiny FLOAT32 Llama both servers train: AdamW, clipping at 1.
v1::CreateModelRequest TinyModelRequest() {
  v1::CreateModelRequest request;
  request.set_model_id(kModelId);
  *request.mutable_config() = TinyModelConfig();
  request.set_seed(7);
  request.set_dtype(v1::DTYPE_FLOAT32);
  request.set_optimizer(v1::OPTIMIZER_ADAMW);
  request.mutable_default_adam()->set_eps(kAdamEps);
  request.set_default_max_grad_norm(kMaxGradNorm);
  return request;
}

// Weights exact in float32, some 0, drawn from `rng`.
std::function<float(int)> QuarterWeights(std::mt19937& rng) {
  return [&rng](int) { return 0.25f * static_cast<float>(rng() % 5); };
}

using Calls = std::vector<std::vector<v1::Sample>>;

// The three ForwardBackward calls of step `step`, of very different sizes:
// five samples of 1 to 60 tokens (one with every target ignored); a sample
// whose only valid position is its last; a 1-token sample beside a long
// weighted one.
Calls StepCalls(int step) {
  std::mt19937 rng(4000 + step);
  std::vector<v1::Sample> many = {
      MakeSample(rng, kVocab, 60, 5),
      MakeSample(rng, kVocab, 17, 0, QuarterWeights(rng)),
      MakeSample(rng, kVocab, 6, 6),
      MakeSample(rng, kVocab, 33, 20, QuarterWeights(rng)),
      MakeSample(rng, kVocab, 1, 0)};
  std::vector<v1::Sample> single_token = {MakeSample(rng, kVocab, 9, 8)};
  std::vector<v1::Sample> lopsided = {
      MakeSample(rng, kVocab, 1, 0),
      MakeSample(rng, kVocab, 48, 0, QuarterWeights(rng))};
  return {many, single_token, lopsided};
}

::testing::AssertionResult RelativelyClose(double single, double multi,
                                           double tolerance) {
  const double scale = std::max({std::abs(single), std::abs(multi), 1e-300});
  const double difference = std::abs(single - multi) / scale;
  if (difference <= tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "1 rank " << single << " vs 4 ranks " << multi
         << ": relative difference " << difference << " > " << tolerance;
}

// max |a - b| over max |a| (both the same length).
double MaxRelativeDifference(const std::vector<double>& a,
                             const std::vector<double>& b) {
  double scale = 1e-300, difference = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::abs(a[i]));
    difference = std::max(difference, std::abs(a[i] - b[i]));
  }
  return difference / scale;
}

struct StepRecord {
  std::vector<v1::ForwardBackwardResponse> calls;
  v1::OptimStepResponse step;
};

absl::StatusOr<StepRecord> TrainStep(TrainerClient& client, const Calls& calls,
                                     v1::LossReduction reduction) {
  StepRecord record;
  for (const std::vector<v1::Sample>& samples : calls) {
    v1::ForwardBackwardRequest request;
    request.set_model_id(kModelId);
    request.set_reduction(reduction);
    for (const v1::Sample& sample : samples) *request.add_samples() = sample;
    TALLY_ASSIGN_OR_RETURN(v1::ForwardBackwardResponse response,
                           client.ForwardBackward(request));
    record.calls.push_back(std::move(response));
  }
  v1::OptimStepRequest step;
  step.set_model_id(kModelId);
  TALLY_ASSIGN_OR_RETURN(record.step, client.OptimStep(step));
  return record;
}

// Both servers counted what the samples hold, and agree on every loss and
// on the step.
void ExpectSameStep(const StepRecord& single, const StepRecord& multi,
                    const Calls& calls, v1::LossReduction reduction) {
  ASSERT_EQ(single.calls.size(), calls.size());
  ASSERT_EQ(multi.calls.size(), calls.size());
  int64_t window_tokens = 0, window_samples = 0;
  for (size_t c = 0; c < calls.size(); ++c) {
    SCOPED_TRACE(absl::StrCat("call ", c));
    int64_t tokens = 0, counted = 0;
    for (const v1::Sample& sample : calls[c]) {
      tokens += ValidTokens(sample);
      counted += ValidTokens(sample) > 0 ? 1 : 0;
    }
    window_tokens += tokens;
    window_samples += counted;
    for (const v1::ForwardBackwardResponse* out :
         {&single.calls[c], &multi.calls[c]}) {
      EXPECT_EQ(out->valid_tokens(), tokens);
      EXPECT_EQ(out->num_samples(), counted);
      EXPECT_EQ(out->accumulated_calls(), static_cast<int64_t>(c + 1));
      EXPECT_EQ(out->accumulated_tokens(), window_tokens);
      EXPECT_EQ(out->accumulated_samples(), window_samples);
      ASSERT_EQ(out->samples_size(), static_cast<int>(calls[c].size()));
    }
    EXPECT_TRUE(RelativelyClose(single.calls[c].loss_sum(),
                                multi.calls[c].loss_sum(), kFloat32Tolerance));
    EXPECT_TRUE(RelativelyClose(single.calls[c].loss_mean(),
                                multi.calls[c].loss_mean(), kFloat32Tolerance));
    for (size_t s = 0; s < calls[c].size(); ++s) {
      SCOPED_TRACE(absl::StrCat("sample ", s));
      EXPECT_EQ(multi.calls[c].samples(s).valid_tokens(),
                ValidTokens(calls[c][s]));
      EXPECT_TRUE(RelativelyClose(single.calls[c].samples(s).loss_sum(),
                                  multi.calls[c].samples(s).loss_sum(),
                                  kFloat32Tolerance));
    }
  }
  const double normalizer = reduction == v1::LOSS_REDUCTION_SAMPLE_MEAN
                                ? window_samples
                                : window_tokens;
  for (const v1::OptimStepResponse* step : {&single.step, &multi.step}) {
    EXPECT_FALSE(step->skipped()) << step->skip_reason();
    EXPECT_EQ(step->normalizer(), normalizer);
    // torch.nn.utils.clip_grad_norm_'s coefficient.
    EXPECT_NEAR(step->clip_coef(),
                std::min(1.0, kMaxGradNorm / (step->grad_norm() + 1e-6)),
                1e-12);
  }
  EXPECT_EQ(multi.step.step(), single.step.step());
  EXPECT_TRUE(RelativelyClose(single.step.grad_norm(), multi.step.grad_norm(),
                              kFloat32Tolerance));
  EXPECT_TRUE(RelativelyClose(single.step.clip_coef(), multi.step.clip_coef(),
                              kFloat32Tolerance));
}

// Forward-only log-probabilities of two fixed samples: a fingerprint of the
// weights.
absl::StatusOr<std::vector<double>> ProbeLogprobs(TrainerClient& client) {
  std::mt19937 rng(99);
  v1::ForwardBackwardRequest request;
  request.set_model_id(kModelId);
  request.set_forward_only(true);
  request.set_return_logprobs(true);
  *request.add_samples() = MakeSample(rng, kVocab, 40, 3);
  *request.add_samples() = MakeSample(rng, kVocab, 25, 0);
  TALLY_ASSIGN_OR_RETURN(v1::ForwardBackwardResponse response,
                         client.ForwardBackward(request));
  std::vector<double> logprobs;
  for (const v1::SampleResult& sample : response.samples()) {
    logprobs.insert(logprobs.end(), sample.logprobs().begin(),
                    sample.logprobs().end());
  }
  return logprobs;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// A safetensors file split into its JSON header and the [begin, end) byte
// ranges of its tensors, read without any tally code.
struct SafetensorsFile {
  std::string header;
  std::string data;
  std::vector<std::pair<size_t, size_t>> ranges;
};

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  TALLY_ASSIGN_OR_RETURN(const std::string bytes, ReadFile(path));
  uint64_t header_size = 0;
  if (bytes.size() < 8) return absl::DataLossError(path + ": too short");
  for (int i = 7; i >= 0; --i) {
    header_size = header_size << 8 | static_cast<unsigned char>(bytes[i]);
  }
  if (bytes.size() < 8 + header_size) {
    return absl::DataLossError(path + ": truncated header");
  }
  SafetensorsFile file;
  file.header = bytes.substr(8, header_size);
  file.data = bytes.substr(8 + header_size);
  constexpr char kKey[] = "\"data_offsets\"";
  for (size_t at = file.header.find(kKey); at != std::string::npos;
       at = file.header.find(kKey, at + 1)) {
    const size_t open = file.header.find('[', at);
    const size_t close = file.header.find(']', open);
    const std::vector<std::string> bounds =
        absl::StrSplit(file.header.substr(open + 1, close - open - 1), ',');
    size_t begin = 0, end = 0;
    if (bounds.size() != 2 ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(bounds[0]), &begin) ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(bounds[1]), &end) ||
        begin > end || end > file.data.size() || (end - begin) % 4 != 0) {
      return absl::DataLossError(
          absl::StrCat(path, ": bad data_offsets near byte ", at));
    }
    file.ranges.emplace_back(begin, end);
  }
  return file;
}

std::vector<double> Float32s(const std::string& data, size_t begin,
                             size_t end) {
  std::vector<double> values((end - begin) / sizeof(float));
  for (size_t i = 0; i < values.size(); ++i) {
    float value;
    std::memcpy(&value, data.data() + begin + i * sizeof(float), sizeof value);
    values[i] = value;
  }
  return values;
}

// Same tensors, names, shapes and dtypes (equal headers: the 4-rank server
// saved whole, unsharded tensors) and every tensor within the float32
// tolerance of its largest magnitude.
void ExpectSafetensorsClose(const std::string& single_path,
                            const std::string& multi_path) {
  SCOPED_TRACE(multi_path);
  TALLY_ASSERT_OK_AND_ASSIGN(const SafetensorsFile single,
                             ReadSafetensors(single_path));
  TALLY_ASSERT_OK_AND_ASSIGN(const SafetensorsFile multi,
                             ReadSafetensors(multi_path));
  EXPECT_EQ(multi.header, single.header);
  EXPECT_THAT(single.header, HasSubstr("\"F32\""));
  EXPECT_THAT(single.header, ::testing::Not(HasSubstr("\"F64\"")));
  ASSERT_EQ(multi.ranges, single.ranges);
  ASSERT_FALSE(single.ranges.empty());
  for (const auto& [begin, end] : single.ranges) {
    EXPECT_LE(MaxRelativeDifference(Float32s(single.data, begin, end),
                                    Float32s(multi.data, begin, end)),
              kFloat32Tolerance)
        << "tensor at bytes [" << begin << ", " << end << ")";
  }
}

void ExpectCheckpointsClose(const std::string& single_dir,
                            const std::string& multi_dir) {
  for (const char* json : {"config.json", "tally.json"}) {
    TALLY_ASSERT_OK_AND_ASSIGN(const std::string single,
                               ReadFile(single_dir + "/" + json));
    TALLY_ASSERT_OK_AND_ASSIGN(const std::string multi,
                               ReadFile(multi_dir + "/" + json));
    EXPECT_EQ(multi, single) << json;
  }
  for (const char* tensors : {"model.safetensors", "optimizer.safetensors"}) {
    ExpectSafetensorsClose(single_dir + "/" + tensors,
                           multi_dir + "/" + tensors);
  }
}

// The value of `name` in a NUL-separated /proc/<pid>/environ.
std::string EnvironmentVariable(const std::string& environ_bytes,
                                const std::string& name) {
  const std::string prefix = name + "=";
  for (absl::string_view entry : absl::StrSplit(environ_bytes, '\0')) {
    if (absl::ConsumePrefix(&entry, prefix)) return std::string(entry);
  }
  return "";
}

// {RANK: pid} of the live child processes of `launcher`, found by scanning
// /proc for processes whose parent it is.
std::map<int, pid_t> RankProcesses(pid_t launcher) {
  std::map<int, pid_t> ranks;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    absl::StatusOr<std::string> stat = ReadFile(entry.path() / "stat");
    if (!stat.ok()) continue;  // exited meanwhile
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    const std::vector<std::string> fields = absl::StrSplit(
        absl::string_view(*stat).substr(stat->rfind(')') + 2), ' ');
    pid_t parent = 0;
    if (fields.size() < 2 || fields[0] == "Z" ||
        !absl::SimpleAtoi(fields[1], &parent) || parent != launcher) {
      continue;
    }
    absl::StatusOr<std::string> environ_bytes =
        ReadFile(entry.path() / "environ");
    int rank = -1;
    if (environ_bytes.ok() &&
        absl::SimpleAtoi(EnvironmentVariable(*environ_bytes, "RANK"), &rank)) {
      ranks[rank] = pid;
    }
  }
  return ranks;
}

class MultiRankE2eTest : public ::testing::Test {
 protected:
  void TearDown() override {
    clients_.clear();  // idle channels would slow gRPC's graceful shutdown
    testing::ExpectCleanShutdown(servers_, kShutdownTimeout);
  }

  // A SERVING server and a client of it; nullptr (with the failure
  // recorded) otherwise. TearDown expects it to exit 0 on SIGTERM.
  TrainerClient* StartServer(const std::vector<std::string>& args) {
    ServerProcess* server = testing::StartServerOrFail(args, servers_);
    return server == nullptr ? nullptr : Connect(*server);
  }

  TrainerClient* Connect(const ServerProcess& server) {
    TrainerClientOptions options;
    options.target = server.grpc_target();
    options.deadline = absl::Seconds(60);
    clients_.push_back(std::make_unique<TrainerClient>(options));
    const absl::Status serving =
        clients_.back()->WaitForServing(absl::Seconds(30));
    if (!serving.ok()) {
      ADD_FAILURE() << serving << "\n" << server.ReadLog();
      return nullptr;
    }
    return clients_.back().get();
  }

  std::string Save(TrainerClient& client, const std::string& name) {
    const std::string dir = servers_.front()->scratch_dir() + "/" + name;
    v1::SaveCheckpointRequest save;
    save.set_model_id(kModelId);
    save.set_path(dir);
    const absl::StatusOr<v1::SaveCheckpointResponse> saved =
        client.SaveCheckpoint(save);
    EXPECT_TRUE(saved.ok()) << saved.status();
    return dir;
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::vector<std::unique_ptr<TrainerClient>> clients_;
};

TEST_F(MultiRankE2eTest, FourRanksTrainAsOneAndCheckpointsCrossLoad) {
  TrainerClient* single = StartServer({});
  TrainerClient* multi = StartServer(DpShardTpFlags());
  ASSERT_NE(single, nullptr);
  ASSERT_NE(multi, nullptr);  // and SERVING
  EXPECT_EQ(RankProcesses(servers_[1]->pid()).size(), 4u);
  ASSERT_TRUE(single->CreateModel(TinyModelRequest()).ok());
  ASSERT_TRUE(multi->CreateModel(TinyModelRequest()).ok());

  int clipped_steps = 0;
  const v1::LossReduction reductions[] = {v1::LOSS_REDUCTION_TOKEN_MEAN,
                                          v1::LOSS_REDUCTION_SAMPLE_MEAN};
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const Calls calls = StepCalls(step);
    TALLY_ASSERT_OK_AND_ASSIGN(const StepRecord on_single,
                               TrainStep(*single, calls, reductions[step]));
    TALLY_ASSERT_OK_AND_ASSIGN(const StepRecord on_multi,
                               TrainStep(*multi, calls, reductions[step]));
    ExpectSameStep(on_single, on_multi, calls, reductions[step]);
    EXPECT_EQ(on_multi.step.step(), step + 1);
    if (on_single.step.clip_coef() < 1) ++clipped_steps;
  }
  EXPECT_GT(clipped_steps, 0) << "clipping was never active";

  TALLY_ASSERT_OK_AND_ASSIGN(const std::vector<double> probe_single,
                             ProbeLogprobs(*single));
  TALLY_ASSERT_OK_AND_ASSIGN(const std::vector<double> probe_multi,
                             ProbeLogprobs(*multi));
  ASSERT_EQ(probe_single.size(), probe_multi.size());
  EXPECT_LE(MaxRelativeDifference(probe_single, probe_multi),
            kFloat32Tolerance);
  const std::string single_dir = Save(*single, "single-2");
  const std::string multi_dir = Save(*multi, "multi-2");
  ExpectCheckpointsClose(single_dir, multi_dir);

  // Different steps on the two servers, so that a load that did nothing
  // would leave them apart.
  ASSERT_TRUE(
      TrainStep(*single, StepCalls(10), v1::LOSS_REDUCTION_TOKEN_MEAN).ok());
  ASSERT_TRUE(
      TrainStep(*multi, StepCalls(11), v1::LOSS_REDUCTION_TOKEN_MEAN).ok());
  for (auto [client, path] :
       {std::pair{single, multi_dir}, std::pair{multi, single_dir}}) {
    v1::LoadCheckpointRequest load;
    load.set_model_id(kModelId);
    load.set_path(path);
    load.set_load_optimizer(true);
    TALLY_ASSERT_OK_AND_ASSIGN(const v1::LoadCheckpointResponse loaded,
                               client->LoadCheckpoint(load));
    EXPECT_EQ(loaded.model().step(), 2);
  }
  // Each server now holds the other's weights.
  TALLY_ASSERT_OK_AND_ASSIGN(const std::vector<double> single_loaded,
                             ProbeLogprobs(*single));
  TALLY_ASSERT_OK_AND_ASSIGN(const std::vector<double> multi_loaded,
                             ProbeLogprobs(*multi));
  EXPECT_LE(MaxRelativeDifference(probe_multi, single_loaded),
            kFloat32Tolerance);
  EXPECT_LE(MaxRelativeDifference(probe_single, multi_loaded),
            kFloat32Tolerance);

  const Calls calls = StepCalls(2);
  TALLY_ASSERT_OK_AND_ASSIGN(
      const StepRecord on_single,
      TrainStep(*single, calls, v1::LOSS_REDUCTION_TOKEN_MEAN));
  TALLY_ASSERT_OK_AND_ASSIGN(
      const StepRecord on_multi,
      TrainStep(*multi, calls, v1::LOSS_REDUCTION_TOKEN_MEAN));
  ExpectSameStep(on_single, on_multi, calls, v1::LOSS_REDUCTION_TOKEN_MEAN);
  EXPECT_EQ(on_multi.step.step(), 3);
}

TEST_F(MultiRankE2eTest, KilledRankStopsTheLauncherWithANonZeroExit) {
  // A short drain, so the launcher's grace period for the ranks is short.
  std::vector<std::string> flags = DpShardTpFlags();
  flags.insert(flags.end(), {"--exit-timeout-secs", "2"});
  absl::StatusOr<std::unique_ptr<ServerProcess>> started =
      ServerProcess::Start(ServerBinaryFromEnv(), flags);
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& launcher = **started;
  TrainerClient* client = Connect(launcher);
  ASSERT_NE(client, nullptr);  // SERVING
  ASSERT_TRUE(client->CreateModel(TinyModelRequest()).ok());

  const std::map<int, pid_t> ranks = RankProcesses(launcher.pid());
  ASSERT_EQ(ranks.size(), 4u) << launcher.ReadLog();
  for (int rank = 0; rank < 4; ++rank) ASSERT_EQ(ranks.count(rank), 1u);
  constexpr int kVictim = 2;
  ASSERT_EQ(kill(ranks.at(kVictim), SIGKILL), 0) << std::strerror(errno);

  // Waits for the launcher to exit without reaping it (WNOWAIT), so that
  // Stop() still collects its exit status.
  const absl::Time killed_at = absl::Now();
  bool exited = false;
  while (!exited && absl::Now() - killed_at < absl::Seconds(30)) {
    siginfo_t info = {};
    ASSERT_EQ(waitid(P_PID, launcher.pid(), &info, WEXITED | WNOHANG | WNOWAIT),
              0)
        << std::strerror(errno);
    exited = info.si_pid == launcher.pid();
    if (!exited) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(exited) << "the launcher still runs 30 s after rank " << kVictim
                      << " died:\n"
                      << launcher.ReadLog();
  const absl::StatusOr<int> exit_code = launcher.Stop(kShutdownTimeout);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_NE(*exit_code, 0);
  EXPECT_THAT(
      launcher.ReadLog(),
      HasSubstr(absl::StrCat("rank ", kVictim, " killed by signal ", SIGKILL)));
  // The launcher reaped every rank before exiting.
  for (const auto& [rank, pid] : ranks) {
    EXPECT_NE(kill(pid, 0), 0)
        << "rank " << rank << " (pid " << pid << ") outlived the launcher";
  }
  // The client gets an error, not a hang.
  v1::GetModelRequest get;
  get.set_model_id(kModelId);
  EXPECT_EQ(client->GetModel(get).status().code(),
            absl::StatusCode::kUnavailable);
}

// A long ForwardBackward: kLongCallSamples samples of 16 tokens, each a
// micro-batch of its own under --max-batch-tokens 16, with collectives in
// every one (tp = 2). Seconds of work even on a fast machine.
constexpr int kLongCallSamples = 4000;

v1::ForwardBackwardRequest LongCall() {
  std::mt19937 rng(77);
  v1::ForwardBackwardRequest request;
  request.set_model_id(kModelId);
  request.set_reduction(v1::LOSS_REDUCTION_TOKEN_MEAN);
  for (int i = 0; i < kLongCallSamples; ++i) {
    *request.add_samples() = MakeSample(rng, kVocab, 16, 8);
  }
  return request;
}

// A rank that hangs (SIGSTOP) in the middle of a long call leaves rank 0 in
// one of the call's collectives: rank 0 keeps answering health checks
// meanwhile, answers the call UNAVAILABLE once --collective-timeout-secs
// passed (not twice that: nothing waits for the hung rank a second time),
// turns NOT_SERVING (and /readyz not ready) and exits 1, so the launcher
// exits non-zero for its supervisor to restart the group.
TEST_F(MultiRankE2eTest, HungRankIsUnavailableWithinTheCollectiveTimeout) {
  constexpr absl::Duration kCollectiveTimeout = absl::Seconds(3);
  // What a loaded 2-core machine may add to the timeout.
  constexpr absl::Duration kMargin = absl::Milliseconds(2500);
  absl::StatusOr<std::unique_ptr<ServerProcess>> started = ServerProcess::Start(
      ServerBinaryFromEnv(),
      {"--nproc-per-node", "2", "--tp", "2", "--collective-timeout-secs",
       absl::StrCat(absl::ToInt64Seconds(kCollectiveTimeout)),
       "--exit-timeout-secs", "5", "--max-batch-tokens", "16"});
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& launcher = **started;
  TrainerClient* client = Connect(launcher);
  ASSERT_NE(client, nullptr);  // SERVING
  ASSERT_TRUE(client->CreateModel(TinyModelRequest()).ok());
  const std::map<int, pid_t> ranks = RankProcesses(launcher.pid());
  ASSERT_EQ(ranks.size(), 2u) << launcher.ReadLog();

  const v1::ForwardBackwardRequest long_call = LongCall();
  std::future<absl::StatusOr<v1::ForwardBackwardResponse>> in_flight =
      std::async(std::launch::async,
                 [&] { return client->ForwardBackward(long_call); });
  // Well inside the call (it runs for seconds), which still runs and is
  // ready: it has not run longer than a collective may wait.
  absl::SleepFor(absl::Milliseconds(1000));
  EXPECT_EQ(testing::HttpGet(launcher.metrics_port(), "/readyz").value_or("?"),
            "ok\n");
  ASSERT_EQ(in_flight.wait_for(std::chrono::seconds(0)),
            std::future_status::timeout)
      << "the long call ended before the rank was stopped";
  ASSERT_EQ(kill(ranks.at(1), SIGSTOP), 0) << std::strerror(errno);
  const absl::Time stopped = absl::Now();

  // The liveness path does not wait for the hung collective.
  const auto health =
      testing::CheckHealth(launcher.grpc_target(), absl::Seconds(2));
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_LT(absl::Now() - stopped, absl::Seconds(1));

  const absl::StatusOr<v1::ForwardBackwardResponse> failed = in_flight.get();
  const absl::Duration detected = absl::Now() - stopped;
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable)
      << failed.status();
  EXPECT_LT(detected, kCollectiveTimeout + kMargin);
  // Not ready from then on: 503 until rank 0 exits, then no answer at all.
  EXPECT_FALSE(testing::HttpGet(launcher.metrics_port(), "/readyz").ok());
  // The hung rank wakes up to a group that is gone.
  kill(ranks.at(1), SIGCONT);
  bool exited = false;
  while (!exited && absl::Now() - stopped < absl::Seconds(60)) {
    siginfo_t info = {};
    ASSERT_EQ(waitid(P_PID, launcher.pid(), &info, WEXITED | WNOHANG | WNOWAIT),
              0);
    exited = info.si_pid == launcher.pid();
    if (!exited) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(exited) << launcher.ReadLog();
  const absl::StatusOr<int> exit_code = launcher.Stop(kShutdownTimeout);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_NE(*exit_code, 0);
  EXPECT_THAT(launcher.ReadLog(), HasSubstr("rank 0 exited with status 1"));
  EXPECT_THAT(launcher.ReadLog(), HasSubstr("a collective failed"));
  v1::GetModelRequest get;
  get.set_model_id(kModelId);
  EXPECT_EQ(client->GetModel(get).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tally
