// tallyctl and tally-server as a user runs them: a command line either one
// refuses exits 2 naming the flag; a busy gRPC or metrics port stops the
// server with one line naming the port and its flag; tallyctl creates
// bfloat16 models, shows GetServerInfo, prints results as JSON with
// --output json, train reports tokens/s and an ETA per step, and sample
// prints the server's Sample response, as text through a local
// tokenizer.json with --tokenizer.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/tokenizer_json.h"
#include "client/trainer_client.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/server_process.h"
#include "tests/testing/held_port.h"

namespace tally {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::tally::testing::HeldPort;
using ::tally::testing::RunCommand;
using ::tally::testing::ServerProcess;
using ::testing::HasSubstr;
using ::testing::Not;

// `$<env_var> args`, its exit status and output (stderr included); bounded
// so that a binary that unexpectedly serves cannot hang the test.
std::pair<int, std::string> RunBinary(const char* env_var,
                                      const std::string& args) {
  const char* binary = std::getenv(env_var);
  EXPECT_NE(binary, nullptr) << env_var << " must name the binary";
  if (binary == nullptr) return {-1, ""};
  return RunCommand(absl::StrCat("timeout 120 ", binary, " ", args));
}

// Parses `text` (protobuf's JSON mapping) into a message of type T.
template <typename T>
T FromJson(const std::string& text) {
  T message;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(text, &message).ok())
      << text;
  return message;
}

struct RefusedCase {
  std::string args;
  std::string message;
};

// `$<env_var> prefix args` exits 2 with `message` in its output for each
// case.
void ExpectExit2Naming(const char* env_var, const std::string& prefix,
                       const std::vector<RefusedCase>& cases) {
  for (const RefusedCase& c : cases) {
    const auto [exit_code, output] =
        RunBinary(env_var, absl::StrCat(prefix, " ", c.args));
    EXPECT_EQ(exit_code, 2) << c.args << "\n" << output;
    EXPECT_THAT(output, HasSubstr(c.message)) << c.args;
  }
}

TEST(CliFlagsE2eTest, TallyctlRefusesABadCommandLineWithExit2) {
  // Refused before any call (there is no server).
  ExpectExit2Naming(
      "TALLY_CTL", "",
      {{"create --dtype int8",
        "flag --dtype: 'int8' is not float32 (fp32), float64 (fp64) or "
        "bfloat16 (bf16), any case, or DTYPE_<NAME>"},
       {"create --dtype fp16", "flag --dtype: 'fp16' is not float32"},
       {"export m out --dtype fp8",
        "flag --dtype: 'fp8' is not float32 (fp32), float64 (fp64), bfloat16 "
        "(bf16) or float16 (fp16)"},
       {"create --optimizer adam", "flag --optimizer: 'adam' is not adamw"},
       {"create --lora-targets attn", "need --lora-rank"},
       {"create --lora-rank 2 --lora-targets attn,ffn",
        "flag --lora-targets: 'ffn' is not attn, mlp or unembed"},
       {"list --output yaml", "flag --output: 'yaml' is not text or json"},
       {"list --frobnicate", "unknown flag --frobnicate"},
       {"info", "expected 1 argument(s) (MODEL), got 0"},
       {"train m --steps 0", "flag --steps: '0' is not >= 1"},
       {"train m --max-len 1", "flag --max-len: '1' is not 0 or >= 2"},
       {"list --deadline-seconds -1", "flag --deadline-seconds: '-1'"},
       {"list --client-cert c.pem", "--client-cert and --client-key go"},
       {"list --ca-cert /nonexistent/ca.pem", "--ca-cert: cannot read"},
       {"frobnicate", "unknown command 'frobnicate'"},
       {"train m --steps", "flag --steps needs a value"},
       {"sample --prompt-ids 1", "flag --model is required"},
       {"sample --model m", "flag --prompt-ids is required"},
       {"sample --model m --prompt-ids 1,x",
        "flag --prompt-ids: '1,x' is not a comma-separated list of token "
        "ids"},
       {"sample --model m --prompt-ids 1 --stop-ids 2,-3",
        "flag --stop-ids: '2,-3' is not"},
       {"sample --model m --prompt-ids 1 --seed -1", "flag --seed: '-1'"},
       {"sample --model m --prompt-ids 1 --skip-special-tokens",
        "flag --skip-special-tokens needs --tokenizer"},
       {"sample --model m --prompt-ids 1 --tokenizer /nonexistent",
        "flag --tokenizer: open /nonexistent/tokenizer.json: No such file"},
       {"sample --model m --prompt-ids 1 --max-tokens 0",
        "flag --max-tokens: '0' is not an integer >= 1"}});
}

TEST(CliFlagsE2eTest, ServerRefusesABadCommandLineWithExit2) {
  ExpectExit2Naming(
      "TALLY_SERVER", "",
      {{"--threads -1", "--threads: expected an integer in [0, 1024]"},
       {"--frobnicate", "unknown flag --frobnicate"},
       {"--demo-model=maybe", "--demo-model: expected true or false"},
       {"--log-level", "--log-level needs a value"}});
  // Found when the server starts (on free ports), after the flags parsed.
  ExpectExit2Naming(
      "TALLY_SERVER", "--host 127.0.0.1 --grpc-port 0 --metrics-port 0",
      {{"--checkpoint-on-exit", "--checkpoint-on-exit needs --checkpoint-dir"},
       {"--shutdown-drain-secs 40 --exit-timeout-secs 30",
        "--shutdown-drain-secs (40) must be less than --exit-timeout-secs"},
       {"--tls-cert /nonexistent/cert.pem", "--tls-cert and --tls-key go"}});
  // Through the launcher: the ranks refuse it, and the launcher exits as
  // they did.
  ExpectExit2Naming("TALLY_SERVER",
                    "--nproc-per-node 2 --dp-replicate 2 --host 127.0.0.1 "
                    "--grpc-port 0 --metrics-port 0",
                    {{"--checkpoint-on-exit",
                      "--checkpoint-on-exit needs --checkpoint-dir"}});
}

// A port another socket listens on stops the server with exit 1 and one
// line naming the flag and the port, not gRPC's or CivetServer's own errors.
void ExpectBusyPortRefused(const std::string& flag) {
  HeldPort held;
  ASSERT_GT(held.port(), 0);
  const absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(testing::ServerBinaryFromEnv(),
                           {flag, absl::StrCat(held.port())});
  ASSERT_FALSE(server.ok()) << flag << " " << held.port() << " was served";
  const std::string log(server.status().message());
  EXPECT_THAT(log, HasSubstr("exit code 1"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat(
                       flag, ": cannot listen on 127.0.0.1:", held.port(),
                       ": Address already in use")));
  EXPECT_THAT(log, Not(HasSubstr("chttp2")));
  EXPECT_THAT(log, Not(HasSubstr("CivetServer")));
}

TEST(CliPortsE2eTest, ABusyGrpcPortIsNamedWithItsFlag) {
  ExpectBusyPortRefused("--grpc-port");
}

TEST(CliPortsE2eTest, ABusyMetricsPortIsNamedWithItsFlag) {
  ExpectBusyPortRefused("--metrics-port");
}

class TallyctlE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = testing::StartServerOrFail({"--threads", "1"}, servers_);
    ASSERT_NE(server_, nullptr);
    TrainerClientOptions options;
    options.target = server_->grpc_target();
    client_ = std::make_unique<TrainerClient>(options);
  }
  void TearDown() override {
    client_.reset();
    testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
  }

  // `tallyctl args` against the server: exit status and output.
  std::pair<int, std::string> Tallyctl(const std::string& args) {
    return RunBinary("TALLY_CTL",
                     absl::StrCat(args, " --target ", server_->grpc_target()));
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  ServerProcess* server_ = nullptr;
  std::unique_ptr<TrainerClient> client_;
};

TEST_F(TallyctlE2eTest, CreatesABfloat16ModelAndPrintsItAsJson) {
  const auto [created, created_output] =
      Tallyctl("create --model-id b --dtype BF16");
  ASSERT_EQ(created, 0) << created_output;
  EXPECT_THAT(created_output, HasSubstr("created model b"));
  EXPECT_THAT(created_output, HasSubstr(", bfloat16, adamw"));
  v1::GetModelRequest get;
  get.set_model_id("b");
  const absl::StatusOr<v1::ModelInfo> info = client_->GetModel(get);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->dtype(), v1::DTYPE_BFLOAT16);

  const auto [shown, json] = Tallyctl("info b --output json");
  ASSERT_EQ(shown, 0) << json;
  EXPECT_EQ(std::count(json.begin(), json.end(), '\n'), 1) << json;
  EXPECT_TRUE(MessageDifferencer::Equals(FromJson<v1::ModelInfo>(json), *info))
      << json;

  const auto [listed, list_json] = Tallyctl("list --output json");
  ASSERT_EQ(listed, 0) << list_json;
  const absl::StatusOr<v1::ListModelsResponse> models =
      client_->ListAllModels();
  ASSERT_TRUE(models.ok()) << models.status();
  EXPECT_TRUE(MessageDifferencer::Equals(
      FromJson<v1::ListModelsResponse>(list_json), *models))
      << list_json;

  const auto [deleted, delete_json] = Tallyctl("delete b --output json");
  ASSERT_EQ(deleted, 0) << delete_json;
  EXPECT_EQ(FromJson<v1::DeleteModelResponse>(delete_json).model().model_id(),
            "b");
}

TEST_F(TallyctlE2eTest, ServerInfoShowsGetServerInfo) {
  const absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const auto [text_code, text] = Tallyctl("server-info");
  ASSERT_EQ(text_code, 0) << text;
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("tally-server ", info->version(), "\n")));
  EXPECT_THAT(
      text,
      HasSubstr(absl::StrCat(
          "  model types: ", absl::StrJoin(info->model_types(), ", "), "\n")));
  EXPECT_THAT(
      text, HasSubstr(absl::StrCat(
                "  features: ", absl::StrJoin(info->features(), ", "), "\n")));
  EXPECT_THAT(text, HasSubstr("  dtypes: float32, float64, bfloat16\n"));
  EXPECT_THAT(
      text, HasSubstr(absl::StrCat(" max_tokens_per_call=",
                                   info->limits().max_tokens_per_call(), " ")));

  const auto [json_code, json] = Tallyctl("server-info --output json");
  ASSERT_EQ(json_code, 0) << json;
  EXPECT_TRUE(MessageDifferencer::Equals(FromJson<v1::ServerInfo>(json), *info))
      << json;
}

TEST_F(TallyctlE2eTest, TrainPrintsTokensPerSecondAndAnEtaPerStep) {
  ASSERT_EQ(Tallyctl("create --model-id t").first, 0);
  const std::string train = "train t --calls-per-step 1 --max-len 32";
  const auto [text_code, text] = Tallyctl(train + " --steps 2");
  ASSERT_EQ(text_code, 0) << text;
  std::vector<std::string> step_lines;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StrContains(line, " tok/s  eta ")) {
      step_lines.emplace_back(line);
    }
  }
  ASSERT_EQ(step_lines.size(), 2u) << text;
  EXPECT_THAT(step_lines[0], HasSubstr("] 1/2  loss "));
  EXPECT_THAT(step_lines[1], HasSubstr("] 2/2  loss "));
  EXPECT_TRUE(absl::EndsWith(step_lines[1], " tok/s  eta 0s")) << text;

  const auto [json_code, json] = Tallyctl(train + " --steps 3 --output json");
  ASSERT_EQ(json_code, 0) << json;
  std::vector<nlohmann::json> records;
  for (absl::string_view line : absl::StrSplit(json, '\n', absl::SkipEmpty())) {
    records.push_back(nlohmann::json::parse(line, nullptr, false));
    ASSERT_FALSE(records.back().is_discarded()) << line;
  }
  ASSERT_EQ(records.size(), 3u) << json;
  for (size_t i = 0; i < records.size(); ++i) {
    const nlohmann::json& r = records[i];
    SCOPED_TRACE(r.dump());
    EXPECT_EQ(r["step"], i + 1);
    EXPECT_EQ(r["steps"], 3);
    EXPECT_EQ(r["model_step"], 2 + i + 1);  // after the 2 text-mode steps
    EXPECT_TRUE(std::isfinite(r["loss"].get<double>()));
    const double seconds = r["seconds"].get<double>();
    const int64_t tokens = r["valid_tokens"].get<int64_t>();
    EXPECT_GT(tokens, 0);
    ASSERT_GT(seconds, 0.0);
    EXPECT_DOUBLE_EQ(r["tokens_per_second"].get<double>(), tokens / seconds);
    EXPECT_GE(r["eta_seconds"].get<double>(), 0.0);
    EXPECT_EQ(r["skipped"], false);
  }
  EXPECT_EQ(records.back()["eta_seconds"], 0.0);
  v1::GetModelRequest get;
  get.set_model_id("t");
  const absl::StatusOr<v1::ModelInfo> info = client_->GetModel(get);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step(), 5);
}

// tallyctl sample prints what Sample answers (the same request through the
// C++ client); each token's log-probability is what ComputeLogprobs gives
// for the completed sequence, up to float32 rounding of the cached forward.
TEST_F(TallyctlE2eTest, SamplePrintsTheServersTokensAndLogprobs) {
  ASSERT_EQ(Tallyctl("create --model-id s").first, 0);
  const std::string sample =
      "sample --model s --prompt-ids 84,104,101 --max-tokens 5 --seed 3 "
      "--num-samples 2 --stop-ids none";
  const auto [json_code, json] = Tallyctl(sample + " --output json");
  ASSERT_EQ(json_code, 0) << json;
  v1::SampleRequest request;
  request.set_model_id("s");
  const std::vector<int32_t> prompt = {84, 104, 101};
  request.add_prompts()->mutable_tokens()->Add(prompt.begin(), prompt.end());
  request.set_num_samples(2);
  request.mutable_params()->set_max_tokens(5);
  request.mutable_params()->set_seed(3);
  request.mutable_params()->mutable_stop();
  const absl::StatusOr<v1::SampleResponse> direct = client_->Sample(request);
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_TRUE(
      MessageDifferencer::Equals(FromJson<v1::SampleResponse>(json), *direct))
      << json;
  ASSERT_EQ(direct->sequences_size(), 2);
  EXPECT_EQ(direct->seed(), 3u);
  EXPECT_EQ(direct->step(), 0);
  const v1::SampledSequence& first = direct->sequences(0);
  EXPECT_EQ(first.tokens_size(), 5);
  EXPECT_EQ(first.stop_reason(), v1::STOP_REASON_LENGTH);

  const auto [text_code, text] = Tallyctl(sample);
  ASSERT_EQ(text_code, 0) << text;
  EXPECT_THAT(text, HasSubstr("model s, step 0, seed 3\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("sample 0 (length): ",
                                           absl::StrJoin(first.tokens(), ","),
                                           "\n  logprobs: ")));

  v1::ComputeLogprobsRequest logprobs;
  logprobs.set_model_id("s");
  v1::TokenSequence& completed = *logprobs.add_prompts();
  completed.mutable_tokens()->Add(prompt.begin(), prompt.end());
  completed.mutable_tokens()->MergeFrom(first.tokens());
  const absl::StatusOr<v1::ComputeLogprobsResponse> computed =
      client_->ComputeLogprobs(logprobs);
  ASSERT_TRUE(computed.ok()) << computed.status();
  ASSERT_EQ(computed->prompts(0).logprobs_size(), 7);
  for (int t = 0; t < first.tokens_size(); ++t) {
    EXPECT_NEAR(computed->prompts(0).logprobs(2 + t), first.logprobs(t), 1e-4)
        << "token " << t;
  }

  // Without --seed the server draws one and says which: it replays.
  const auto [drawn_code, drawn_json] = Tallyctl(
      "sample --model s --prompt-ids 84,104,101 --max-tokens 5 "
      "--stop-ids none --output json");
  ASSERT_EQ(drawn_code, 0) << drawn_json;
  const auto drawn = FromJson<v1::SampleResponse>(drawn_json);
  request.set_num_samples(1);
  request.mutable_params()->set_seed(drawn.seed());
  const absl::StatusOr<v1::SampleResponse> replayed = client_->Sample(request);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*replayed, drawn)) << drawn_json;

  const absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->features(), ::testing::Contains("sample"));
  const auto [refused, message] =
      Tallyctl("sample --model s --prompt-ids 1,100000");
  EXPECT_EQ(refused, 1) << message;
  EXPECT_THAT(message, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(message, HasSubstr("prompts[0].tokens[1] = 100000"));
}

// A byte-level tokenizer.json for a model of `vocab_size` ids: id b < 256
// is byte b in GPT-2's byte-level alphabet (the printable Latin-1 bytes as
// themselves, the others in order from U+0100), 256 is "<s>" and the rest
// "<extra_N>", all three special added tokens.
nlohmann::json ByteLevelTokenizerJson(int vocab_size) {
  nlohmann::json vocab = nlohmann::json::object();
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable =
        (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int code_point = printable ? b : next++;
    std::string utf8;
    if (code_point < 0x80) {
      utf8 += static_cast<char>(code_point);
    } else {
      utf8 += static_cast<char>(0xC0 | (code_point >> 6));
      utf8 += static_cast<char>(0x80 | (code_point & 0x3F));
    }
    vocab[utf8] = b;
  }
  nlohmann::json added = nlohmann::json::array();
  for (int id = 256; id < vocab_size; ++id) {
    added.push_back({{"id", id},
                     {"content", id == 256 ? std::string("<s>")
                                           : absl::StrCat("<extra_", id, ">")},
                     {"special", true}});
  }
  return {{"added_tokens", added},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {}}}}};
}

// The text HF's ByteLevel decoder makes of `ids` with that tokenizer.
std::string ByteLevelText(const v1::SampledSequence& sequence,
                          bool skip_special) {
  std::string bytes;
  for (int32_t id : sequence.tokens()) {
    if (id < 256) {
      bytes += static_cast<char>(id);
    } else if (!skip_special) {
      bytes +=
          id == 256 ? std::string("<s>") : absl::StrCat("<extra_", id, ">");
    }
  }
  return Utf8Lossy(bytes);
}

// tallyctl sample --tokenizer DIR prints the prompt and each sequence as
// text, decoded on the client's side from DIR/tokenizer.json; --output json
// adds the text to the response's fields.
TEST_F(TallyctlE2eTest, SampleWithATokenizerPrintsText) {
  ASSERT_EQ(Tallyctl("create --model-id s").first, 0);
  v1::GetModelRequest get;
  get.set_model_id("s");
  const absl::StatusOr<v1::ModelInfo> info = client_->GetModel(get);
  ASSERT_TRUE(info.ok()) << info.status();
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      absl::StrCat("cli_e2e_tokenizer_", getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json")
      << ByteLevelTokenizerJson(info->config().vocab_size()).dump();

  v1::SampleRequest request;
  request.set_model_id("s");
  const std::vector<int32_t> prompt = {84, 104, 101};
  request.add_prompts()->mutable_tokens()->Add(prompt.begin(), prompt.end());
  request.set_num_samples(3);
  request.mutable_params()->set_max_tokens(12);
  request.mutable_params()->set_seed(5);
  request.mutable_params()->mutable_stop();
  const absl::StatusOr<v1::SampleResponse> direct = client_->Sample(request);
  ASSERT_TRUE(direct.ok()) << direct.status();
  const std::string sample = absl::StrCat(
      "sample --model s --prompt-ids 84,104,101 --max-tokens 12 --seed 5 "
      "--num-samples 3 --stop-ids none --tokenizer ",
      dir.string());

  const auto [text_code, text] = Tallyctl(sample + " --ids");
  ASSERT_EQ(text_code, 0) << text;
  EXPECT_THAT(text, HasSubstr("prompt: \"The\"\n"));
  for (int i = 0; i < 3; ++i) {
    const v1::SampledSequence& sequence = direct->sequences(i);
    EXPECT_THAT(text, HasSubstr(absl::StrCat(
                          "sample ", i, " (length): ",
                          nlohmann::json(ByteLevelText(sequence, false)).dump(),
                          "\n  ids: ", absl::StrJoin(sequence.tokens(), ","),
                          "\n  logprobs: ")));
  }

  const auto [json_code, json] =
      Tallyctl(sample + " --skip-special-tokens --output json");
  ASSERT_EQ(json_code, 0) << json;
  const nlohmann::json record = nlohmann::json::parse(json);
  EXPECT_EQ(record["prompt_text"], "The");
  EXPECT_TRUE(MessageDifferencer::Equals(FromJson<v1::SampleResponse>([&] {
                                           nlohmann::json proto = record;
                                           proto.erase("prompt_text");
                                           for (auto& sequence :
                                                proto["sequences"])
                                             sequence.erase("text");
                                           return proto.dump();
                                         }()),
                                         *direct))
      << json;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(record["sequences"][i]["text"],
              ByteLevelText(direct->sequences(i), true))
        << i;
  }

  // A tokenizer that lacks an id exits 2 naming the flag.
  std::ofstream(dir / "tokenizer.json") << ByteLevelTokenizerJson(0).dump();
  const auto [lacking_code, lacking] = Tallyctl(absl::StrCat(
      "sample --model s --prompt-ids 84,256 --tokenizer ", dir.string()));
  EXPECT_EQ(lacking_code, 2) << lacking;
  EXPECT_THAT(lacking, HasSubstr("token id 256 has no token in"));
  std::filesystem::remove_all(dir);
}

// tallyctl samplers save / list / delete and sample --sampler: the snapshot
// samples what the live weights sampled when it was saved.
TEST_F(TallyctlE2eTest, SamplersSaveListDeleteAndSampleFromOne) {
  ASSERT_EQ(Tallyctl("create --model-id s").first, 0);
  const auto [saved_code, saved] = Tallyctl("samplers save s first");
  ASSERT_EQ(saved_code, 0) << saved;
  EXPECT_THAT(saved, HasSubstr("saved tally://s/samplers/first: model s, "
                               "step 0"));
  const std::string sample =
      "sample --model s --prompt-ids 84,104,101 --max-tokens 4 --seed 3 "
      "--stop-ids none --output json";
  const auto [live_code, live] = Tallyctl(sample);
  ASSERT_EQ(live_code, 0) << live;
  const auto [frozen_code, frozen] = Tallyctl(sample + " --sampler first");
  ASSERT_EQ(frozen_code, 0) << frozen;
  EXPECT_TRUE(MessageDifferencer::Equals(FromJson<v1::SampleResponse>(frozen),
                                         FromJson<v1::SampleResponse>(live)))
      << frozen;

  const auto [listed_code, listed] =
      Tallyctl("samplers list --model s --output json");
  ASSERT_EQ(listed_code, 0) << listed;
  const auto list = FromJson<v1::ListSamplersResponse>(listed);
  ASSERT_EQ(list.samplers_size(), 1) << listed;
  EXPECT_EQ(list.samplers(0).name(), "first");
  EXPECT_EQ(list.samplers(0).path(), "tally://s/samplers/first");

  const auto [repeat_code, repeat] = Tallyctl("samplers save s first");
  EXPECT_EQ(repeat_code, 1) << repeat;
  EXPECT_THAT(repeat, HasSubstr("ALREADY_EXISTS"));
  ASSERT_EQ(Tallyctl("samplers delete s first").first, 0);
  EXPECT_THAT(Tallyctl("samplers list").second,
              HasSubstr("no sampler snapshots"));
  const auto [gone_code, gone] = Tallyctl(sample + " --sampler first");
  EXPECT_EQ(gone_code, 1) << gone;
  EXPECT_THAT(gone, HasSubstr("sampler 'first'"));
  // The server refuses a bad name: INVALID_ARGUMENT, exit status 1.
  EXPECT_EQ(Tallyctl("samplers save s a/b").first, 1);
}

}  // namespace
}  // namespace tally
