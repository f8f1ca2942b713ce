// End-to-end tests of ExportWeights with real tally-server processes: a
// float32 export loads back through CreateModel.init_checkpoint bit for bit
// (tied embeddings too, without lm_head.weight); a bfloat16 export is the
// round-to-nearest-even of the float32 weights, checked against bit
// arithmetic on the file's bytes; tokenizer files and config.json fields of
// an HF init_checkpoint come along; bad requests get the right code and write
// nothing; a sequenced export runs exactly once, keeps the pending window and
// holds every earlier step; a 2-rank --tp 2 server writes the single-rank
// bytes; `tallyctl export`.
#include <google/protobuf/util/message_differencer.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/trainer_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/server_process.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

using ::google::protobuf::util::MessageDifferencer;
using ::tally::testing::kTinyVocab;
using ::tally::testing::MakeSample;
using ::tally::testing::ReadFileBytes;
using ::tally::testing::RunCommand;
using ::tally::testing::ServerProcess;
using ::tally::testing::StartServerOrFail;
using ::testing::HasSubstr;

constexpr int32_t kVocab = testing::kTinyVocab;

v1::CreateModelRequest TinyModel(const std::string& model_id,
                                 bool tied = false) {
  v1::CreateModelRequest request;
  request.set_model_id(model_id);
  *request.mutable_config() = testing::TinyModelConfig();
  request.mutable_config()->set_tie_word_embeddings(tied);
  request.set_seed(23);
  request.mutable_default_adam()->set_learning_rate(1e-2);
  return request;
}

// A tensor of a safetensors file, read independently of tally's reader.
struct StoredTensor {
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  std::string bytes;
};

// Every tensor of the safetensors file at `path` by name; `metadata`, when
// given, gets its "__metadata__".
std::map<std::string, StoredTensor> ReadTensors(
    const std::string& path,
    std::map<std::string, std::string>* metadata = nullptr) {
  std::map<std::string, StoredTensor> tensors;
  const std::string file = ReadFileBytes(path);
  uint64_t header_size = 0;  // little-endian, like the host
  if (file.size() < sizeof header_size) {
    ADD_FAILURE() << path << " has no safetensors header";
    return tensors;
  }
  std::memcpy(&header_size, file.data(), sizeof header_size);
  const nlohmann::json header =
      nlohmann::json::parse(file.substr(sizeof header_size, header_size));
  const size_t data = sizeof header_size + header_size;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (metadata != nullptr) {
        *metadata = entry.get<std::map<std::string, std::string>>();
      }
      continue;
    }
    const size_t begin = entry.at("data_offsets")[0].get<size_t>();
    const size_t end = entry.at("data_offsets")[1].get<size_t>();
    tensors[name] = {entry.at("dtype").get<std::string>(),
                     entry.at("shape").get<std::vector<int64_t>>(),
                     file.substr(data + begin, end - begin)};
  }
  return tensors;
}

// The bfloat16 nearest to the float32 of `bits`, ties to even (finite).
uint16_t RoundToBfloat16(uint32_t bits) {
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

nlohmann::json ReadJson(const std::string& path) {
  return nlohmann::json::parse(ReadFileBytes(path), nullptr,
                               /*allow_exceptions=*/false);
}

class ExportE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::temp_directory_path() / "tally-export-e2e-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    root_ = dir_ + "/root";
  }
  // `tallyctl ARGS --target <the last server started>`: its exit status and
  // output.
  std::pair<int, std::string> Tallyctl(const std::string& args) {
    const char* tallyctl = std::getenv("TALLY_CTL");
    EXPECT_NE(tallyctl, nullptr) << "TALLY_CTL must name the tallyctl binary";
    if (tallyctl == nullptr || servers_.empty()) return {-1, ""};
    return RunCommand(absl::StrCat(tallyctl, " ", args, " --target ",
                                   servers_.back()->grpc_target()));
  }

  void TearDown() override {
    clients_.clear();  // idle connections would hold the shutdown
    testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
    fs::remove_all(dir_);
  }

  // A server confined to root_ (--checkpoint-root) with `flags`, and a
  // client of it; null (and a test failure) when it does not start.
  TrainerClient* Start(std::vector<std::string> flags = {}) {
    flags.insert(flags.end(), {"--checkpoint-root", root_});
    ServerProcess* server = StartServerOrFail(flags, servers_);
    if (server == nullptr) return nullptr;
    TrainerClientOptions options;
    options.target = server->grpc_target();
    clients_.push_back(std::make_unique<TrainerClient>(options));
    return clients_.back().get();
  }

  // Where the server puts a relative `path`.
  std::string InRoot(const std::string& path) const {
    return (fs::canonical(root_) / path).string();
  }

  // A tiny model exported to `path` under the root, its checksum list
  // removed: a plain HF directory to edit and create models from.
  bool ExportPlainHfDirectory(TrainerClient& client, const std::string& path) {
    if (!client.CreateModel(TinyModel("m")).ok() ||
        !client.ExportWeights(ExportRequest("m", path)).ok()) {
      return false;
    }
    return fs::remove(InRoot(path) + "/checksums.sha256");
  }

  static v1::ExportWeightsRequest ExportRequest(
      const std::string& model_id, const std::string& path,
      v1::DType dtype = v1::DTYPE_UNSPECIFIED, uint64_t seq_id = 0) {
    v1::ExportWeightsRequest request;
    request.set_model_id(model_id);
    request.set_path(path);
    request.set_dtype(dtype);
    request.set_seq_id(seq_id);
    return request;
  }

  // SaveCheckpoint of `model_id` to `path` (relative to the root); returns
  // its model.safetensors.
  std::string SavedWeights(TrainerClient& client, const std::string& model_id,
                           const std::string& path, uint64_t seq_id = 0) {
    v1::SaveCheckpointRequest save;
    save.set_model_id(model_id);
    save.set_path(path);
    save.set_seq_id(seq_id);
    const absl::StatusOr<v1::SaveCheckpointResponse> saved =
        client.SaveCheckpoint(save);
    EXPECT_TRUE(saved.ok()) << saved.status();
    return ReadFileBytes(InRoot(path) + "/model.safetensors");
  }

  // Exports `model_id` in float32, creates a model from the export and
  // checks both models' checkpoints hold the same weights, bit for bit, as
  // the export does. Returns the export's directory.
  std::string ExpectFloat32RoundTrip(TrainerClient& client,
                                     const std::string& model_id) {
    const std::string path = model_id + "-fp32";
    const absl::StatusOr<v1::ExportWeightsResponse> exported =
        client.ExportWeights(ExportRequest(model_id, path));
    const std::string dir = InRoot(path);
    if (!exported.ok()) {
      ADD_FAILURE() << exported.status();
      return dir;
    }
    EXPECT_EQ(exported->path(), dir);
    EXPECT_THAT(exported->files(),
                ::testing::ElementsAre("checksums.sha256", "config.json",
                                       "model.safetensors"));
    uint64_t bytes = 0;
    for (const std::string& file : exported->files()) {
      bytes += fs::file_size(dir + "/" + file);
    }
    EXPECT_EQ(exported->bytes_written(), bytes);
    EXPECT_EQ(ReadJson(dir + "/config.json").value("torch_dtype", ""),
              "float32");

    v1::CreateModelRequest copy;
    copy.set_model_id(model_id + "-copy");
    copy.set_init_checkpoint(path);
    const absl::StatusOr<v1::ModelInfo> created = client.CreateModel(copy);
    EXPECT_TRUE(created.ok()) << created.status();
    const std::string original =
        SavedWeights(client, model_id, model_id + "-checkpoint");
    EXPECT_FALSE(original.empty());
    EXPECT_TRUE(original == ReadFileBytes(dir + "/model.safetensors"))
        << "the export's weights differ from the model's";
    EXPECT_TRUE(original == SavedWeights(client, model_id + "-copy",
                                         model_id + "-copy-checkpoint"))
        << "the model created from the export differs";
    return dir;
  }

  std::string dir_;
  std::string root_;
  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::vector<std::unique_ptr<TrainerClient>> clients_;
};

TEST_F(ExportE2eTest, Float32ExportLoadsBackBitwise) {
  TrainerClient* client = Start();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->CreateModel(TinyModel("m")).ok());
  testing::Train(*client, "m", kVocab, 1, 2);
  const std::string dir = ExpectFloat32RoundTrip(*client, "m");
  const std::map<std::string, StoredTensor> tensors =
      ReadTensors(dir + "/model.safetensors");
  EXPECT_TRUE(tensors.count("lm_head.weight"));
  ASSERT_TRUE(tensors.count("model.embed_tokens.weight"));
  EXPECT_EQ(tensors.at("model.embed_tokens.weight").shape,
            (std::vector<int64_t>{kVocab, testing::kTinyHidden}));
}

TEST_F(ExportE2eTest, TiedEmbeddingWritesNoLmHead) {
  TrainerClient* client = Start();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->CreateModel(TinyModel("tied", /*tied=*/true)).ok());
  testing::Train(*client, "tied", kVocab, 1, 1);
  const std::string dir = ExpectFloat32RoundTrip(*client, "tied");
  const std::map<std::string, StoredTensor> tensors =
      ReadTensors(dir + "/model.safetensors");
  EXPECT_TRUE(tensors.count("model.embed_tokens.weight"));
  EXPECT_FALSE(tensors.count("lm_head.weight"));
  EXPECT_EQ(ReadJson(dir + "/config.json").value("tie_word_embeddings", false),
            true);
}

// Checked on the stored bytes against the float32 export of the same weights,
// rounded here with integer arithmetic.
TEST_F(ExportE2eTest, Bfloat16IsRoundToNearestEvenOfFloat32) {
  TrainerClient* client = Start();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->CreateModel(TinyModel("m")).ok());
  testing::Train(*client, "m", kVocab, 1, 2);
  for (auto [path, dtype] : {std::pair{"fp32", v1::DTYPE_FLOAT32},
                             std::pair{"bf16", v1::DTYPE_BFLOAT16},
                             std::pair{"fp16", v1::DTYPE_FLOAT16}}) {
    const absl::Status exported =
        client->ExportWeights(ExportRequest("m", path, dtype)).status();
    ASSERT_TRUE(exported.ok()) << exported;
  }
  EXPECT_EQ(ReadJson(InRoot("bf16/config.json")).value("torch_dtype", ""),
            "bfloat16");
  EXPECT_EQ(ReadJson(InRoot("fp16/config.json")).value("torch_dtype", ""),
            "float16");
  std::map<std::string, std::string> metadata;
  const std::map<std::string, StoredTensor> fp32 =
      ReadTensors(InRoot("fp32/model.safetensors"));
  const std::map<std::string, StoredTensor> bf16 =
      ReadTensors(InRoot("bf16/model.safetensors"), &metadata);
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(bf16.size(), fp32.size());
  int64_t rounded_up = 0;
  for (const auto& [name, wide] : fp32) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(bf16.count(name));
    const StoredTensor& narrow = bf16.at(name);
    EXPECT_EQ(wide.dtype, "F32");
    EXPECT_EQ(narrow.dtype, "BF16");
    EXPECT_EQ(narrow.shape, wide.shape);
    ASSERT_EQ(narrow.bytes.size() * 2, wide.bytes.size());
    for (size_t i = 0; i < narrow.bytes.size() / 2; ++i) {
      uint32_t bits;
      uint16_t stored;
      std::memcpy(&bits, wide.bytes.data() + 4 * i, 4);
      std::memcpy(&stored, narrow.bytes.data() + 2 * i, 2);
      ASSERT_EQ(stored, RoundToBfloat16(bits)) << "element " << i;
      rounded_up += stored != static_cast<uint16_t>(bits >> 16);
    }
  }
  EXPECT_GT(rounded_up, 0);  // truncation would have passed otherwise
  for (const auto& [name, half] :
       ReadTensors(InRoot("fp16/model.safetensors"))) {
    EXPECT_EQ(half.dtype, "F16") << name;
  }
}

// A model created from an HF directory exports its generation config and
// tokenizer files, and the config.json fields tally does not write.
TEST_F(ExportE2eTest, TokenizerFilesAndConfigFieldsComeAlong) {
  TrainerClient* client = Start();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(ExportPlainHfDirectory(*client, "hf"));
  const std::string hf = InRoot("hf");
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(ReadFileBytes(hf + "/config.json"));
  config["bos_token_id"] = 1;
  config["eos_token_id"] = 2;
  config["pad_token_id"] = 0;
  std::ofstream(hf + "/config.json") << config.dump(2);
  const std::map<std::string, std::string> copied = {
      {"tokenizer.json", R"({"version": "1.0", "model": {"type": "BPE"}})"},
      {"tokenizer_config.json", R"({"model_max_length": 64})"},
      {"special_tokens_map.json", R"({"eos_token": "</s>"})"},
      {"generation_config.json", R"({"bos_token_id": 1, "eos_token_id": 2})"}};
  for (const auto& [name, text] : copied) {
    std::ofstream(hf + "/" + name) << text;
  }
  v1::CreateModelRequest from_hf;
  from_hf.set_model_id("from-hf");
  from_hf.set_init_checkpoint("hf");
  ASSERT_TRUE(client->CreateModel(from_hf).ok());

  const absl::StatusOr<v1::ExportWeightsResponse> exported =
      client->ExportWeights(
          ExportRequest("from-hf", "out", v1::DTYPE_BFLOAT16));
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_THAT(exported->files(),
              ::testing::ElementsAre(
                  "checksums.sha256", "config.json", "generation_config.json",
                  "model.safetensors", "special_tokens_map.json",
                  "tokenizer.json", "tokenizer_config.json"));
  for (const auto& [name, text] : copied) {
    EXPECT_EQ(ReadFileBytes(InRoot("out/" + name)), text) << name;
  }
  const nlohmann::json written = ReadJson(InRoot("out/config.json"));
  EXPECT_EQ(written.value("bos_token_id", -1), 1);
  EXPECT_EQ(written.value("eos_token_id", -1), 2);
  EXPECT_EQ(written.value("pad_token_id", -1), 0);
  EXPECT_EQ(written.value("torch_dtype", ""), "bfloat16");  // tally's wins
  EXPECT_EQ(written.value("model_type", ""), "llama");
}

// Files built to crash or exhaust the server through CreateModel: a shard
// index and a config.json nested far deeper than a recursive copy or dump()
// can go, a header declaring a 64 GiB tensor (a hole on disk). Each gets its
// code with a short message naming the file, and the server lives on.
TEST_F(ExportE2eTest, HostileModelDirectoriesAreRefusedAndTheServerLives) {
  TrainerClient* client = Start();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(ExportPlainHfDirectory(*client, "hf"));
  const std::string hf = InRoot("hf");
  const std::string config = ReadFileBytes(hf + "/config.json");
  const std::string nesting =
      std::string(100000, '[') + std::string(100000, ']');
  auto refusal = [&](const std::string& dir) {
    v1::CreateModelRequest create;
    create.set_model_id(dir);
    create.set_init_checkpoint(dir);
    return client->CreateModel(create).status();
  };

  fs::copy(hf, InRoot("indexed"));
  fs::rename(InRoot("indexed/model.safetensors"),
             InRoot("indexed/model-00001-of-00001.safetensors"));
  std::ofstream(InRoot("indexed/model.safetensors.index.json"))
      << R"({"weight_map":{"a":)" << nesting << "}}";
  absl::Status status = refusal("indexed");
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("model.safetensors.index.json nests arrays and "
                        "objects deeper than 64 levels (at weight_map.a[]"));
  EXPECT_LE(status.message().size(), 600u);

  fs::copy(hf, InRoot("deep-config"));
  std::string deep = config;
  deep.insert(deep.rfind('}'), R"(, "extra": )" + nesting);
  std::ofstream(InRoot("deep-config/config.json")) << deep;
  status = refusal("deep-config");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("config.json nests arrays and objects deeper than 64 "
                        "levels (at extra[]"));
  EXPECT_LE(status.message().size(), 600u);

  fs::copy(hf, InRoot("huge"));
  std::string header =
      R"({"model.embed_tokens.weight":{"dtype":"F32",)"
      R"("shape":[16777216,1024],"data_offsets":[0,68719476736]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) {
    file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  }
  const std::string weights = InRoot("huge/model.safetensors");
  std::ofstream(weights, std::ios::binary | std::ios::trunc) << file + header;
  fs::resize_file(weights, 8 + header.size() + (uint64_t{64} << 30));
  status = refusal("huge");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("checkpoint weight model.embed_tokens.weight has "
                        "shape [16777216, 1024], expected ["));

  // Alive, and nothing was created.
  EXPECT_TRUE(client->CreateModel(TinyModel("after")).ok());
  v1::GetModelRequest get;
  get.set_model_id("huge");
  EXPECT_EQ(client->GetModel(get).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ExportE2eTest, BadRequestsGetTheirCodeAndWriteNothing) {
  TrainerClient* client = Start();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->CreateModel(TinyModel("m")).ok());
  // float16 is a storage dtype only (bfloat16 trains, in mixed precision).
  v1::CreateModelRequest create = TinyModel("storage");
  create.set_dtype(v1::DTYPE_FLOAT16);
  const absl::Status refused = client->CreateModel(create).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("DTYPE_FLOAT16"));
  SavedWeights(*client, "m", "checkpoint");
  fs::create_directories(InRoot("data"));
  std::ofstream(InRoot("data/notes.txt")) << "precious";
  const struct {
    v1::ExportWeightsRequest request;
    absl::StatusCode code;
    const char* named;  // in the message
  } cases[] = {
      {ExportRequest("m", ""), absl::StatusCode::kInvalidArgument, "path"},
      {ExportRequest("m", "x1", static_cast<v1::DType>(42)),
       absl::StatusCode::kInvalidArgument, "dtype"},
      {ExportRequest("no such", "x2"), absl::StatusCode::kInvalidArgument,
       "model_id"},
      {ExportRequest("nope", "x3"), absl::StatusCode::kNotFound, "nope"},
      {ExportRequest("m", "../x4"), absl::StatusCode::kPermissionDenied, ""},
      {ExportRequest("m", "data"), absl::StatusCode::kFailedPrecondition,
       "data"},
      {ExportRequest("m", "checkpoint"), absl::StatusCode::kFailedPrecondition,
       "checkpoint"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.request.ShortDebugString());
    const absl::Status status = client->ExportWeights(c.request).status();
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.named));
  }
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(root_)) {
    left.push_back(entry.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"checkpoint", "data"}));
  EXPECT_FALSE(fs::exists(dir_ + "/x4"));
  EXPECT_EQ(ReadFileBytes(InRoot("data/notes.txt")), "precious");
  EXPECT_TRUE(fs::exists(InRoot("checkpoint/tally.json")));
}

// A sequenced export runs once in the model's sequence: a retry gets the
// cached response and writes nothing, another payload under its seq_id is
// refused. It keeps the pending window, which the next step consumes, and
// holds the weights of every earlier step.
TEST_F(ExportE2eTest, SequencedExportIsExactlyOnce) {
  TrainerClient* client = Start();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->CreateModel(TinyModel("m")).ok());
  uint64_t seq_id = 0;
  testing::Train(*client, "m", kVocab, 1, 1, &seq_id);
  v1::ForwardBackwardRequest pending = testing::StepWindow("m", 2, kVocab)[0];
  pending.set_seq_id(++seq_id);
  ASSERT_TRUE(client->ForwardBackward(pending).ok());

  const v1::ExportWeightsRequest once =
      ExportRequest("m", "once", v1::DTYPE_UNSPECIFIED, ++seq_id);
  const absl::StatusOr<v1::ExportWeightsResponse> first =
      client->ExportWeights(once);
  ASSERT_TRUE(first.ok()) << first.status();
  v1::GetModelRequest get;
  get.set_model_id("m");
  const absl::StatusOr<v1::ModelInfo> info = client->GetModel(get);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->accumulated_calls(), 1);  // the window stays
  EXPECT_EQ(info->next_seq_id(), seq_id + 1);

  fs::remove_all(InRoot("once"));
  const absl::StatusOr<v1::ExportWeightsResponse> replayed =
      client->ExportWeights(once);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*first, *replayed));
  EXPECT_FALSE(fs::exists(InRoot("once")));  // not written again
  const absl::Status conflict =
      client
          ->ExportWeights(
              ExportRequest("m", "other", v1::DTYPE_UNSPECIFIED, seq_id))
          .status();
  EXPECT_EQ(conflict.code(), absl::StatusCode::kAlreadyExists) << conflict;
  EXPECT_FALSE(fs::exists(InRoot("other")));

  v1::OptimStepRequest optim;
  optim.set_model_id("m");
  optim.set_seq_id(++seq_id);
  const absl::StatusOr<v1::OptimStepResponse> stepped =
      client->OptimStep(optim);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->step(), 2);
  EXPECT_EQ(stepped->normalizer(),
            testing::ValidTokens(pending.samples(0)) +
                testing::ValidTokens(pending.samples(1)));
  ASSERT_TRUE(client
                  ->ExportWeights(ExportRequest(
                      "m", "after", v1::DTYPE_UNSPECIFIED, ++seq_id))
                  .ok());
  EXPECT_TRUE(SavedWeights(*client, "m", "checkpoint", ++seq_id) ==
              ReadFileBytes(InRoot("after/model.safetensors")));

  // Two exports ran; the replay and the conflict did not.
  const ServerProcess& server = *servers_.back();
  const absl::StatusOr<std::string> metrics =
      testing::HttpGet(server.metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(testing::MetricValue(*metrics, "tally_checkpoint_seconds_count",
                                 {{"kind", "export"}})
                .value_or(-1),
            2);
}

// Every rank takes part: a 2-rank --tp 2 server writes the bytes a 1-rank
// server writes for the same (freshly initialized) model.
TEST_F(ExportE2eTest, TensorParallelServerWritesTheSingleRankBytes) {
  TrainerClient* single = Start();
  ASSERT_NE(single, nullptr);
  TrainerClient* multi = Start({"--nproc-per-node", "2", "--tp", "2"});
  ASSERT_NE(multi, nullptr);
  for (TrainerClient* client : {single, multi}) {
    ASSERT_TRUE(client->CreateModel(TinyModel("m")).ok());
  }
  ASSERT_TRUE(
      single->ExportWeights(ExportRequest("m", "single", v1::DTYPE_BFLOAT16, 1))
          .ok());
  ASSERT_TRUE(
      multi->ExportWeights(ExportRequest("m", "multi", v1::DTYPE_BFLOAT16, 1))
          .ok());
  for (const char* file : {"config.json", "model.safetensors"}) {
    const std::string want = ReadFileBytes(InRoot("single/") + file);
    ASSERT_FALSE(want.empty()) << file;
    EXPECT_TRUE(want == ReadFileBytes(InRoot("multi/") + file))
        << file << " differs";
  }
}

// A LoRA adapter exports as PEFT's two files (the factors under PEFT's key
// names) or, with merge, as a full HF directory; a 2-rank --tp 2 server,
// whose factors are split and gathered, writes the single rank's bytes.
TEST_F(ExportE2eTest, LoraAdapterExportsAsPeftOrMergedWhateverTheMesh) {
  TrainerClient* single = Start();
  ASSERT_NE(single, nullptr);
  TrainerClient* multi = Start({"--nproc-per-node", "2", "--tp", "2"});
  ASSERT_NE(multi, nullptr);
  v1::CreateModelRequest create = TinyModel("a");
  create.mutable_lora()->set_rank(4);
  create.mutable_lora()->set_alpha(8);
  create.mutable_lora()->set_train_mlp(false);
  for (TrainerClient* client : {single, multi}) {
    ASSERT_TRUE(client->CreateModel(create).ok());
  }
  for (const char* path : {"single", "multi"}) {
    TrainerClient* client = path == std::string("single") ? single : multi;
    ASSERT_TRUE(client->ExportWeights(ExportRequest("a", path)).ok());
    v1::ExportWeightsRequest merged =
        ExportRequest("a", absl::StrCat(path, "-merged"));
    merged.set_merge(true);
    ASSERT_TRUE(client->ExportWeights(merged).ok());
  }
  const nlohmann::json config = ReadJson(InRoot("single/adapter_config.json"));
  EXPECT_EQ(config.value("r", 0), 4);
  EXPECT_EQ(config.value("lora_alpha", 0.0), 8.0);
  EXPECT_EQ(
      config["target_modules"],
      nlohmann::json({"q_proj", "k_proj", "v_proj", "o_proj", "lm_head"}));
  const auto factors = ReadTensors(InRoot("single/adapter_model.safetensors"));
  ASSERT_FALSE(factors.empty());
  for (const auto& [name, t] : factors) {
    EXPECT_THAT(name, ::testing::StartsWith("base_model.model."));
    EXPECT_THAT(name, ::testing::AnyOf(HasSubstr(".lora_A.weight"),
                                       HasSubstr(".lora_B.weight")));
  }
  EXPECT_TRUE(ReadTensors(InRoot("single-merged/model.safetensors"))
                  .count("model.layers.0.self_attn.q_proj.weight"));
  for (const char* file :
       {"adapter_model.safetensors", "adapter_config.json"}) {
    EXPECT_TRUE(ReadFileBytes(InRoot("single/") + file) ==
                ReadFileBytes(InRoot("multi/") + file))
        << file << " differs";
  }
  EXPECT_TRUE(ReadFileBytes(InRoot("single-merged/model.safetensors")) ==
              ReadFileBytes(InRoot("multi-merged/model.safetensors")));
  // tallyctl creates adapters and says what they are.
  const auto [created, output] =
      Tallyctl("create --model-id c --lora-rank 2 --lora-targets attn,unembed");
  EXPECT_EQ(created, 0) << output;
  EXPECT_THAT(output, HasSubstr("LoRA adapter: rank=2 alpha=32 attn=true "
                                "mlp=false unembed=true"));
  const auto [exported, export_output] = Tallyctl("export c ctl --merge");
  EXPECT_EQ(exported, 0) << export_output;
  EXPECT_TRUE(fs::exists(InRoot("ctl/config.json")));
  const auto [refused, refused_output] =
      Tallyctl("create --model-id d --lora-rank 2 --lora-targets attn,ffn");
  EXPECT_EQ(refused, 2);  // a command-line error
  EXPECT_THAT(refused_output, HasSubstr("'ffn' is not attn, mlp or unembed"));
}

TEST_F(ExportE2eTest, TallyctlExportsWithADtype) {
  TrainerClient* client = Start();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->CreateModel(TinyModel("m")).ok());
  const auto [exit_code, output] = Tallyctl("export m ctl --dtype bfloat16");
  EXPECT_EQ(exit_code, 0) << output;
  EXPECT_THAT(output,
              HasSubstr("exported the weights of model m to " + InRoot("ctl")));
  EXPECT_EQ(ReadJson(InRoot("ctl/config.json")).value("torch_dtype", ""),
            "bfloat16");
  const auto [refused_code, refused] = Tallyctl("export m ctl2 --dtype int8");
  EXPECT_EQ(refused_code, 2) << refused;  // a command-line error
  EXPECT_THAT(refused, HasSubstr("'int8' is not float32 (fp32), float64 "
                                 "(fp64), bfloat16 (bf16) or float16 (fp16)"));
  EXPECT_FALSE(fs::exists(InRoot("ctl2")));
}

// tallyctl's commands that change a model carry its next seq_ids (a retry
// is answered from the server's cache) while save and export, which change
// nothing, take none; save refuses a pending window unless --allow-pending,
// and abort discards it.
TEST_F(ExportE2eTest, TallyctlSequencesItsCallsAndHandlesAPendingWindow) {
  TrainerClient* client = Start();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->CreateModel(TinyModel("m")).ok());
  auto next_seq_id = [&] {
    v1::GetModelRequest get;
    get.set_model_id("m");
    absl::StatusOr<v1::ModelInfo> info = client->GetModel(get);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->next_seq_id() : 0;
  };
  ASSERT_EQ(next_seq_id(), 1u);

  std::mt19937 rng(5);
  v1::ForwardBackwardRequest pending;
  pending.set_model_id("m");
  *pending.add_samples() = MakeSample(rng, kTinyVocab, 9, 2);
  ASSERT_TRUE(client->ForwardBackward(pending).ok());  // unsequenced

  const auto [refused_code, refused] = Tallyctl("save m saved");
  EXPECT_EQ(refused_code, 1) << refused;
  EXPECT_THAT(refused, HasSubstr("FAILED_PRECONDITION"));
  EXPECT_EQ(next_seq_id(), 1u);

  const auto [saved_code, saved] = Tallyctl("save m saved --allow-pending");
  EXPECT_EQ(saved_code, 0) << saved;
  EXPECT_THAT(saved,
              HasSubstr("without the pending window: 1 calls, 7 tokens"));
  EXPECT_EQ(next_seq_id(), 1u);

  const auto [exported_code, exported] = Tallyctl("export m exported");
  EXPECT_EQ(exported_code, 0) << exported;
  EXPECT_EQ(next_seq_id(), 1u);

  const auto [aborted_code, aborted] = Tallyctl("abort m");
  EXPECT_EQ(aborted_code, 0) << aborted;
  EXPECT_THAT(aborted, HasSubstr("discarded the pending window of model m: 1 "
                                 "calls, 7 tokens, 1 samples"));
  EXPECT_EQ(next_seq_id(), 2u);  // abort changes the model: sequenced
  const auto [resaved_code, resaved] = Tallyctl("save m saved");
  EXPECT_EQ(resaved_code, 0) << resaved;
  const auto [loaded_code, loaded] = Tallyctl("load m saved");
  EXPECT_EQ(loaded_code, 0) << loaded;
  EXPECT_EQ(next_seq_id(), 3u);
}

}  // namespace
}  // namespace tally
