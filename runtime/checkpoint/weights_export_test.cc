// Weights export (runtime/checkpoint/weights_export.h, Engine::ExportWeights):
// HF's shard split and index, dtypes, HF names (tied, mixtral), the source
// directory's files and config fields, what an export may replace, pending
// windows, the command path and request validation, and exports of sharded
// and staged meshes, which must equal the single-rank export byte for byte.
#include "runtime/checkpoint/weights_export.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/engine/engine.h"
#include "runtime/io/safetensors.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/mesh.h"
#include "server/commands.h"
#include "server/convert.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

using testing::AllEqual;
using testing::MakeSamples;
using testing::ParameterValues;
using testing::TinyConfig;
using testing::TinySpec;

constexpr int64_t kVocab = 48;  // TinyConfig's

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

std::string BytesOf(const torch::Tensor& t) {
  torch::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()),
                     c.numel() * c.element_size());
}

uint64_t TensorBytes(const torch::Tensor& t) {
  return static_cast<uint64_t>(t.numel() * t.element_size());
}

// The tensors of every safetensors file of an export, by name.
std::map<std::string, torch::Tensor> ExportedTensors(
    const std::string& dir, const std::vector<std::string>& files) {
  std::map<std::string, torch::Tensor> tensors;
  for (const std::string& file : files) {
    if (!absl::EndsWith(file, ".safetensors")) continue;
    absl::StatusOr<NamedTensors> read = ReadSafetensors(dir + "/" + file);
    EXPECT_TRUE(read.ok()) << read.status();
    for (auto& [name, t] : read.value_or(NamedTensors())) {
      EXPECT_TRUE(tensors.emplace(name, t).second) << name << " twice";
    }
  }
  return tensors;
}

TEST(SplitIntoShardsTest, FollowsHuggingFaceHub) {
  using Shards = std::vector<std::vector<size_t>>;
  EXPECT_EQ(SplitIntoShards({4, 4, 4}, 12), (Shards{{0, 1, 2}}));
  EXPECT_EQ(SplitIntoShards({4, 4, 4}, 8), (Shards{{0, 1}, {2}}));
  EXPECT_EQ(SplitIntoShards({8, 1}, 8), (Shards{{0}, {1}}));
  // A tensor over the limit gets a shard of its own, ahead of the shard
  // being filled, which goes on filling.
  EXPECT_EQ(SplitIntoShards({4, 10, 4, 1}, 8), (Shards{{1}, {0, 2}, {3}}));
  EXPECT_EQ(SplitIntoShards({}, 8), Shards{});
}

class WeightsExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::path(::testing::TempDir()) / "weights_export_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
    engine_ = Engine::CreateSingleRank({}).value();
    ASSERT_TRUE(Create("m", TinyConfig()).ok());
  }
  void TearDown() override { fs::remove_all(root_); }

  // A float32 model of `config` that took one step.
  absl::Status Create(const std::string& id, const LlamaConfig& config) {
    ModelSpec spec = TinySpec(id, DType::kFloat32, OptimizerKind::kAdamW);
    spec.config = config;
    TALLY_RETURN_IF_ERROR(engine_->CreateModel(spec).status());
    TALLY_RETURN_IF_ERROR(
        engine_->ForwardBackward(id, {MakeSamples(kVocab, {4, 3}, 1)})
            .status());
    return engine_->OptimStep(id, {}).status();
  }
  CausalLm& model(const std::string& id = "m") {
    return *EngineTestPeer::Model(*engine_, id).value();
  }
  std::string PathOf(const std::string& name) const {
    return (fs::path(root_) / name).string();
  }
  ExportResult Export(const std::string& name, ExportOptions options = {},
                      const std::string& id = "m") {
    absl::StatusOr<ExportResult> exported =
        engine_->ExportWeights(id, PathOf(name), options);
    EXPECT_TRUE(exported.ok()) << exported.status();
    return exported.value_or(ExportResult());
  }

  std::string root_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(WeightsExportTest, SmallShardLimitWritesHfShardsAndIndex) {
  ExportOptions options;
  options.max_shard_bytes = 8192;
  const ExportResult exported = Export("sharded", options);
  const std::string dir = PathOf("sharded");
  EXPECT_EQ(exported.path, dir);

  std::set<std::string> shard_files;
  for (const std::string& file : exported.files) {
    if (absl::EndsWith(file, ".safetensors")) shard_files.insert(file);
  }
  const size_t n = shard_files.size();
  ASSERT_GT(n, 2u);
  std::vector<std::string> expected_files = {"checksums.sha256", "config.json",
                                             "model.safetensors.index.json"};
  for (size_t i = 1; i <= n; ++i) {
    expected_files.push_back(
        absl::StrFormat("model-%05d-of-%05d.safetensors", i, n));
  }
  std::sort(expected_files.begin(), expected_files.end());
  EXPECT_EQ(exported.files, expected_files);
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));

  // Every parameter exactly once, each in the shard the index names, and a
  // shard over the limit only for a tensor over it.
  const std::string index_text =
      ReadText(dir + "/model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(index_text);
  EXPECT_EQ(index_text, index.dump(2) + "\n");  // sorted keys, indent 2
  ASSERT_EQ(index.size(), 2u);
  const nlohmann::json& weight_map = index.at("weight_map");
  uint64_t total_size = 0;
  size_t tensors = 0;
  for (const std::string& file : shard_files) {
    std::map<std::string, std::string> metadata;
    absl::StatusOr<NamedTensors> shard =
        ReadSafetensors(dir + "/" + file, &metadata);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
    uint64_t shard_bytes = 0;
    for (const auto& [name, t] : *shard) {
      EXPECT_EQ(weight_map.at(name), file) << name;
      shard_bytes += TensorBytes(t);
      ++tensors;
    }
    EXPECT_TRUE(shard_bytes <= options.max_shard_bytes || shard->size() == 1)
        << file;
    total_size += shard_bytes;
  }
  EXPECT_EQ(index.at("metadata"), nlohmann::json({{"total_size", total_size}}));
  EXPECT_EQ(tensors, weight_map.size());
  EXPECT_EQ(tensors, model().parameters().size());

  // tally reads the sharded export back bitwise.
  absl::StatusOr<CheckpointContents> read = ReadCheckpoint(dir, false);
  ASSERT_TRUE(read.ok()) << read.status();
  std::map<std::string, torch::Tensor> by_name(read->weights.begin(),
                                               read->weights.end());
  for (const Parameter& p : model().parameters()) {
    ASSERT_TRUE(by_name.count(p.name)) << p.name;
    EXPECT_EQ(BytesOf(by_name[p.name]), BytesOf(p.tensor)) << p.name;
  }
}

TEST_F(WeightsExportTest, Float32RoundTripsThroughInitCheckpointBitwise) {
  const ExportResult exported = Export("fp32");
  EXPECT_EQ(exported.files,
            (std::vector<std::string>{"checksums.sha256", "config.json",
                                      "model.safetensors"}));
  ModelSpec spec = TinySpec("copy", DType::kFloat32, OptimizerKind::kAdamW);
  spec.config = LlamaConfig();
  spec.init_checkpoint = exported.path;
  ASSERT_TRUE(engine_->CreateModel(spec).ok());
  EXPECT_TRUE(
      AllEqual(ParameterValues(model("copy")), ParameterValues(model("m"))));
  // The model's own checkpoint holds the very same weights file.
  ASSERT_TRUE(engine_->SaveCheckpoint("m", PathOf("checkpoint")).ok());
  EXPECT_EQ(ReadText(PathOf("checkpoint/model.safetensors")),
            ReadText(PathOf("fp32/model.safetensors")));
}

TEST_F(WeightsExportTest, StorageDTypesAreTorchCasts) {
  for (auto [dtype, scalar, name] :
       {std::tuple{ExportDType::kBFloat16, torch::kBFloat16, "bfloat16"},
        std::tuple{ExportDType::kFloat16, torch::kFloat16, "float16"},
        std::tuple{ExportDType::kFloat64, torch::kFloat64, "float64"}}) {
    SCOPED_TRACE(name);
    ExportOptions options;
    options.dtype = dtype;
    const ExportResult exported = Export(name, options);
    const nlohmann::json config =
        nlohmann::json::parse(ReadText(exported.path + "/config.json"));
    EXPECT_EQ(config.at("torch_dtype"), name);
    const std::map<std::string, torch::Tensor> tensors =
        ExportedTensors(exported.path, exported.files);
    for (const Parameter& p : model().parameters()) {
      ASSERT_TRUE(tensors.count(p.name)) << p.name;
      EXPECT_EQ(tensors.at(p.name).scalar_type(), scalar);
      EXPECT_EQ(BytesOf(tensors.at(p.name)), BytesOf(p.tensor.to(scalar)))
          << p.name;
    }
  }
}

TEST_F(WeightsExportTest, TiedModelWritesNoLmHead) {
  ASSERT_TRUE(Create("tied", TinyConfig(/*tie_word_embeddings=*/true)).ok());
  const ExportResult exported = Export("tied", {}, "tied");
  const std::map<std::string, torch::Tensor> tensors =
      ExportedTensors(exported.path, exported.files);
  EXPECT_TRUE(tensors.count("model.embed_tokens.weight"));
  EXPECT_FALSE(tensors.count("lm_head.weight"));
  EXPECT_EQ(tensors.size(), model("tied").parameters().size());
}

TEST_F(WeightsExportTest, MixtralWritesPerExpertNames) {
  LlamaConfig config = TinyConfig();
  config.num_local_experts = 4;
  config.num_experts_per_tok = 2;
  ASSERT_TRUE(Create("moe", config).ok());
  const ExportResult exported = Export("moe", {}, "moe");
  const std::map<std::string, torch::Tensor> tensors =
      ExportedTensors(exported.path, exported.files);
  for (int e = 0; e < 4; ++e) {
    for (const char* w : {"w1", "w2", "w3"}) {
      EXPECT_TRUE(tensors.count(absl::StrCat(
          "model.layers.1.block_sparse_moe.experts.", e, ".", w, ".weight")))
          << e << w;
    }
  }
  EXPECT_FALSE(
      tensors.count("model.layers.1.block_sparse_moe.experts.w1.weight"));
  ModelSpec spec = TinySpec("moe_copy", DType::kFloat32, OptimizerKind::kSgd);
  spec.config = LlamaConfig();
  spec.init_checkpoint = exported.path;
  ASSERT_TRUE(engine_->CreateModel(spec).ok());
  EXPECT_TRUE(AllEqual(ParameterValues(model("moe_copy")),
                       ParameterValues(model("moe"))));
}

// The source directory's generation config and tokenizer files are copied;
// its config.json fields tally does not write are carried over after
// tally's, which win; fields on how the source stored its weights are not.
TEST_F(WeightsExportTest, CopiesSourceFilesAndCarriesConfigFields) {
  const std::string source = PathOf("source");
  fs::create_directories(source);
  WriteText(source + "/config.json",
            R"({"vocab_size": 7, "bos_token_id": 1, "eos_token_id": [2, 3],
                "torch_dtype": "bfloat16", "dtype": "bfloat16",
                "quantization_config": {"bits": 4},
                "custom": {"nested": [1, 2]}})");
  const std::map<std::string, std::string> copied = {
      {"tokenizer.json", R"({"model": {"type": "BPE"}})"},
      {"generation_config.json", R"({"eos_token_id": 2})"},
      {"chat_template.jinja", "{{ messages }}"},
      {"merges.txt", ""}};
  for (const auto& [name, text] : copied) WriteText(source + "/" + name, text);
  WriteText(source + "/notes.txt", "not a tokenizer file");

  absl::StatusOr<ExportResult> exported =
      WriteWeightsExport(PathOf("out"), model(), {}, source);
  ASSERT_TRUE(exported.ok()) << exported.status();
  std::vector<std::string> expected = {"checksums.sha256", "config.json",
                                       "model.safetensors"};
  for (const auto& [name, text] : copied) {
    expected.push_back(name);
    EXPECT_EQ(ReadText(PathOf("out/" + name)), text) << name;
  }
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(exported->files, expected);

  const nlohmann::ordered_json written =
      nlohmann::ordered_json::parse(ReadText(PathOf("out/config.json")));
  const nlohmann::ordered_json tally =
      nlohmann::ordered_json::parse(model().config().ToHfJson("float32"));
  nlohmann::ordered_json want = tally;
  want["bos_token_id"] = 1;
  want["eos_token_id"] = {2, 3};
  want["custom"] = {{"nested", {1, 2}}};
  EXPECT_EQ(written, want);  // ordered: tally's fields, then the carried ones
  EXPECT_EQ(written.at("vocab_size"), kVocab);

  // A source directory that is gone adds nothing; a broken config.json is
  // refused.
  absl::StatusOr<ExportResult> without =
      WriteWeightsExport(PathOf("out"), model(), {}, PathOf("gone"));
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_EQ(without->files.size(), 3u);
  WriteText(source + "/config.json", "[1, 2]");
  const absl::Status broken =
      WriteWeightsExport(PathOf("broken"), model(), {}, source).status();
  EXPECT_EQ(broken.code(), absl::StatusCode::kFailedPrecondition) << broken;
  EXPECT_FALSE(fs::exists(PathOf("broken")));
}

// An unknown config.json field nested far deeper than nlohmann's recursive
// copy and dump() can go: creating a model from the directory is refused
// naming config.json and the field; an export whose source config.json
// turned so since is refused the same way, and neither crashes. Files the
// export copies are bounded in size too.
TEST_F(WeightsExportTest, DeepOrOversizedSourceFilesAreRefused) {
  const std::string hf = Export("hf").path;
  fs::remove(hf + "/checksums.sha256");  // a plain HF directory now
  const std::string config = ReadText(hf + "/config.json");
  std::string deep = config;
  deep.insert(deep.rfind('}'), R"(, "extra": )" + std::string(300000, '[') +
                                   std::string(300000, ']'));
  auto expect_refused = [&](const absl::Status& status, absl::StatusCode code) {
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(std::string(status.message()),
                ::testing::HasSubstr(hf + "/config.json"));
    EXPECT_THAT(std::string(status.message()),
                ::testing::HasSubstr("deeper than 64 levels (at extra[][]"));
    EXPECT_LE(status.message().size(), 600u);
  };

  ModelSpec spec = TinySpec("from_hf", DType::kFloat32, OptimizerKind::kAdamW);
  spec.config = LlamaConfig();
  spec.init_checkpoint = hf;
  WriteText(hf + "/config.json", deep);
  expect_refused(engine_->CreateModel(spec).status(),
                 absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(engine_->GetModel("from_hf").ok());

  WriteText(hf + "/config.json", config);
  ASSERT_TRUE(engine_->CreateModel(spec).ok());
  WriteText(hf + "/config.json", deep);
  expect_refused(engine_->ExportWeights("from_hf", PathOf("deep"), {}).status(),
                 absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(fs::exists(PathOf("deep")));

  // 1 GiB of tokenizer, a hole: refused from its size, unread.
  WriteText(hf + "/config.json", config);
  WriteText(hf + "/tokenizer.json", "");
  ASSERT_EQ(::truncate((hf + "/tokenizer.json").c_str(), off_t{1} << 30), 0);
  const absl::Status copied =
      engine_->ExportWeights("from_hf", PathOf("huge"), {}).status();
  EXPECT_EQ(copied.code(), absl::StatusCode::kFailedPrecondition) << copied;
  EXPECT_THAT(std::string(copied.message()),
              ::testing::HasSubstr(hf + "/tokenizer.json is 1073741824 bytes"));
}

// The engine takes the source from the model's init_checkpoint.
TEST_F(WeightsExportTest, ModelFromAnHfDirectoryKeepsItsTokenizer) {
  const std::string hf = Export("hf").path;
  fs::remove(hf + "/checksums.sha256");  // a plain HF directory now
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(ReadText(hf + "/config.json"));
  config["eos_token_id"] = 2;
  WriteText(hf + "/config.json", config.dump());
  WriteText(hf + "/tokenizer_config.json", R"({"model_max_length": 512})");
  ModelSpec spec = TinySpec("from_hf", DType::kFloat32, OptimizerKind::kAdamW);
  spec.config = LlamaConfig();
  spec.init_checkpoint = hf;
  ASSERT_TRUE(engine_->CreateModel(spec).ok());
  const ExportResult exported = Export("again", {}, "from_hf");
  EXPECT_EQ(ReadText(exported.path + "/tokenizer_config.json"),
            R"({"model_max_length": 512})");
  EXPECT_EQ(nlohmann::json::parse(ReadText(exported.path + "/config.json"))
                .at("eos_token_id"),
            2);
}

TEST_F(WeightsExportTest, ReplacesOnlyAnEarlierExport) {
  Export("dir");
  ExportOptions bf16;
  bf16.dtype = ExportDType::kBFloat16;
  Export("dir", bf16);  // replaced
  EXPECT_TRUE(
      absl::StrContains(ReadText(PathOf("dir/config.json")), "\"bfloat16\""));
  // Neither a checkpoint nor other data is replaced by an export, nor an
  // export by a checkpoint.
  ASSERT_TRUE(engine_->SaveCheckpoint("m", PathOf("checkpoint")).ok());
  fs::create_directories(PathOf("data"));
  WriteText(PathOf("data/notes.txt"), "precious");
  for (const char* taken : {"checkpoint", "data"}) {
    const absl::Status refused =
        engine_->ExportWeights("m", PathOf(taken)).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  }
  EXPECT_TRUE(fs::exists(PathOf("checkpoint/tally.json")));
  EXPECT_EQ(ReadText(PathOf("data/notes.txt")), "precious");
  EXPECT_EQ(engine_->SaveCheckpoint("m", PathOf("dir")).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(WeightsExportTest, FailuresWriteNothing) {
  ExportOptions no_shards;
  no_shards.max_shard_bytes = 0;
  const struct {
    std::string model_id;
    std::string path;
    ExportOptions options;
    absl::StatusCode code;
  } cases[] = {
      {"m", PathOf("zero"), no_shards, absl::StatusCode::kInvalidArgument},
      {"nope", PathOf("unknown"), {}, absl::StatusCode::kNotFound},
      {"m", "/", {}, absl::StatusCode::kInvalidArgument},
  };
  for (const auto& c : cases) {
    const absl::Status status =
        engine_->ExportWeights(c.model_id, c.path, c.options).status();
    EXPECT_EQ(status.code(), c.code) << status;
  }
  EXPECT_EQ(
      std::distance(fs::directory_iterator(root_), fs::directory_iterator()),
      0);
}

// Gradients are not weights: a pending window neither blocks an export nor
// changes, and the export holds the weights before the window.
TEST_F(WeightsExportTest, PendingWindowNeitherBlocksNorChanges) {
  const std::vector<torch::Tensor> weights = ParameterValues(model());
  ASSERT_TRUE(
      engine_->ForwardBackward("m", {MakeSamples(kVocab, {5, 2}, 2)}).ok());
  const ExportResult exported = Export("pending");
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 1);
  absl::StatusOr<CheckpointContents> read =
      ReadCheckpoint(exported.path, false);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->weights.size(), weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    EXPECT_EQ(BytesOf(read->weights[i].second), BytesOf(weights[i]));
  }
  EXPECT_TRUE(engine_->OptimStep("m", {}).ok());
}

// The command table's entry, as every rank runs it: the response names what
// the engine wrote.
TEST_F(WeightsExportTest, CommandFillsTheResponse) {
  v1::ExportWeightsRequest request;
  request.set_model_id("m");
  request.set_path(PathOf("command"));
  request.set_dtype(v1::DTYPE_BFLOAT16);
  v1::ExportWeightsResponse response;
  ASSERT_TRUE(CommandRunner(engine_->control(), *engine_, nullptr)
                  .Run(kExportWeightsCommand, request, &response)
                  .ok());
  EXPECT_EQ(response.path(), PathOf("command"));
  EXPECT_EQ(std::vector<std::string>(response.files().begin(),
                                     response.files().end()),
            (std::vector<std::string>{"checksums.sha256", "config.json",
                                      "model.safetensors"}));
  uint64_t bytes = 0;
  for (const std::string& file : response.files()) {
    bytes += fs::file_size(PathOf("command/" + file));
  }
  EXPECT_EQ(response.bytes_written(), bytes);
}

TEST(ExportRequestTest, ValidationNamesTheField) {
  v1::ExportWeightsRequest request;
  request.set_model_id("m");
  EXPECT_TRUE(absl::StrContains(ParseExportWeights(request).status().message(),
                                "path"));
  request.set_path("out");
  EXPECT_EQ(ParseExportWeights(request)->dtype, ExportDType::kModel);
  EXPECT_EQ(ParseExportWeights(request)->max_shard_bytes,
            kDefaultMaxShardBytes);
  request.set_dtype(v1::DTYPE_FLOAT16);
  EXPECT_EQ(ParseExportWeights(request)->dtype, ExportDType::kFloat16);
  request.set_dtype(static_cast<v1::DType>(42));
  const absl::Status bad_dtype = ParseExportWeights(request).status();
  EXPECT_EQ(bad_dtype.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(bad_dtype.message(), "dtype")) << bad_dtype;

  // float16 is a storage dtype, no training dtype (bfloat16 is both:
  // MixedPrecisionTest.TheApiCallsItDtypeBfloat16).
  v1::CreateModelRequest create;
  create.set_dtype(v1::DTYPE_FLOAT16);
  const absl::Status refused = ParseCreateModel(create).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.message(), "dtype")) << refused;
}

// This rank's engine of a deployment laid out as `shape`.
absl::StatusOr<std::unique_ptr<Engine>> RankEngine(const MeshShape& shape,
                                                   const RankEnv& env) {
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
  TALLY_ASSIGN_OR_RETURN(auto groups,
                         ProcessGroups::Create(env, mesh, absl::Seconds(60)));
  return Engine::Create({}, mesh, std::move(groups));
}

// Every rank takes part in gathering a tp-sharded or pipelined model (a tied
// one across its stages); rank 0 writes exactly the single-rank export.
TEST(WeightsExportMultiRankTest, MeshesExportTheSingleRankBytes) {
  struct Case {
    std::string name;
    MeshShape shape;
    bool tied;
  };
  std::vector<Case> cases(2);
  cases[0] = {"tp2", {}, false};
  cases[0].shape.tp = 2;
  cases[1] = {"pp2", {}, true};
  cases[1].shape.pp = 2;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ModelSpec spec = TinySpec("x", DType::kFloat32, OptimizerKind::kAdamW);
    spec.config = TinyConfig(c.tied);
    // The ranks are children of this process.
    auto dir = [&c](const std::string& kind) {
      return absl::StrCat(::testing::TempDir(), "tally_export_", getppid(), "_",
                          c.name, "_", kind);
    };
    testing::RunOnRanks(2, [&](const RankEnv& env) -> absl::Status {
      TALLY_ASSIGN_OR_RETURN(auto engine, RankEngine(c.shape, env));
      TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
      ExportOptions options;
      options.dtype = ExportDType::kBFloat16;
      TALLY_RETURN_IF_ERROR(
          engine->ExportWeights("x", dir("mesh"), options).status());
      if (env.rank != 0) return absl::OkStatus();
      TALLY_ASSIGN_OR_RETURN(auto single, Engine::CreateSingleRank({}));
      TALLY_RETURN_IF_ERROR(single->CreateModel(spec).status());
      TALLY_RETURN_IF_ERROR(
          single->ExportWeights("x", dir("single"), options).status());
      for (const char* file : {"config.json", "model.safetensors"}) {
        EXPECT_EQ(ReadText(dir("mesh") + "/" + file),
                  ReadText(dir("single") + "/" + file))
            << file;
      }
      fs::remove_all(dir("mesh"));
      fs::remove_all(dir("single"));
      return absl::OkStatus();
    });
  }
}

}  // namespace
}  // namespace tally
