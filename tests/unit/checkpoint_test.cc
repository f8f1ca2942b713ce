#include "runtime/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdio.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "runtime/llama_model.h"
#include "runtime/optimizer.h"
#include "runtime/safetensors.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

using ::testing::HasSubstr;

LlamaConfig TinyConfig(bool tied) {
  LlamaConfig c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.tie_word_embeddings = tied;
  return c.WithDefaults();
}

// A model whose every parameter depends on `seed`: norm weights start at one
// whatever the seed, so all parameters get a seeded perturbation.
std::unique_ptr<LlamaModel> MakeModel(bool tied, DType dtype, uint64_t seed) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Create(TinyConfig(tied), dtype, seed);
  EXPECT_TRUE(model.ok()) << model.status();
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (Parameter& p : (*model)->parameters()) {
    p.tensor.add_(torch::randn_like(p.tensor), 0.1);
  }
  return std::move(model).value();
}

// Gives every parameter a gradient drawn from `seed`.
void SetFakeGradients(LlamaModel& model, uint64_t seed) {
  torch::manual_seed(seed);
  for (Parameter& p : model.parameters()) {
    p.tensor.mutable_grad() = torch::randn_like(p.tensor);
  }
}

// The memory of a tensor, for bitwise comparison.
std::string BytesOf(const torch::Tensor& t) {
  torch::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()),
                     c.numel() * c.element_size());
}

NamedTensors Snapshot(const LlamaModel& model) {
  NamedTensors out;
  for (const Parameter& p : model.parameters()) {
    out.emplace_back(p.name, p.tensor.detach().clone());
  }
  return out;
}

void ExpectBitwiseEqual(const NamedTensors& expected,
                        const NamedTensors& actual) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE(expected[i].first);
    EXPECT_EQ(actual[i].first, expected[i].first);
    EXPECT_EQ(actual[i].second.scalar_type(), expected[i].second.scalar_type());
    EXPECT_EQ(actual[i].second.sizes(), expected[i].second.sizes());
    EXPECT_EQ(BytesOf(actual[i].second), BytesOf(expected[i].second));
  }
}

// True when no parameter of `model` equals its counterpart in `snapshot`, so
// a later equality proves something was copied.
bool DiffersEverywhere(const LlamaModel& model, const NamedTensors& snapshot) {
  for (size_t i = 0; i < snapshot.size(); ++i) {
    if (torch::equal(model.parameters()[i].tensor, snapshot[i].second)) {
      return false;
    }
  }
  return true;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

CheckpointManifest SampleManifest() {
  CheckpointManifest m;
  m.step = 1;
  m.default_adam.learning_rate = 3e-4;
  m.default_adam.beta1 = 0.8;
  m.default_adam.beta2 = 0.95;
  m.default_adam.eps = 1e-7;
  m.default_adam.weight_decay = 0.1;
  m.default_max_grad_norm = 1.5;
  return m;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::path(::testing::TempDir()) / "checkpoint_test_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string PathOf(const std::string& name) const {
    return (fs::path(root_) / name).string();
  }

  // A checkpoint of a freshly initialized float32 model (seed 1), no steps.
  std::string WriteFreshCheckpoint(bool tied, OptimizerKind kind) {
    std::unique_ptr<LlamaModel> model = MakeModel(tied, DType::kFloat32, 1);
    Optimizer optimizer(kind, &model->parameters());
    const std::string dir = PathOf("fresh");
    EXPECT_TRUE(
        WriteCheckpoint(dir, *model, optimizer, CheckpointManifest()).ok());
    return dir;
  }

  std::string root_;
};

class CheckpointRoundTripTest
    : public CheckpointTest,
      public ::testing::WithParamInterface<std::tuple<DType, bool>> {};

TEST_P(CheckpointRoundTripTest, RestoresWeightsAndOptimizerBitwise) {
  const auto [dtype, tied] = GetParam();
  std::unique_ptr<LlamaModel> model = MakeModel(tied, dtype, 1);
  Optimizer optimizer(OptimizerKind::kAdamW, &model->parameters());
  SetFakeGradients(*model, 11);
  ASSERT_TRUE(optimizer.Step(AdamParams()).ok());
  const CheckpointManifest manifest = SampleManifest();

  const std::string dir = PathOf("nested/ckpt");  // parents created
  absl::StatusOr<uint64_t> bytes =
      WriteCheckpoint(dir, *model, optimizer, manifest);
  ASSERT_TRUE(bytes.ok()) << bytes.status();

  std::set<std::string> files;
  uint64_t bytes_on_disk = 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    files.insert(entry.path().filename().string());
    bytes_on_disk += entry.file_size();
  }
  EXPECT_EQ(files,
            (std::set<std::string>{"config.json", "model.safetensors",
                                   "optimizer.safetensors", "tally.json"}));
  EXPECT_EQ(*bytes, bytes_on_disk);

  // config.json is HF's, with the model dtype.
  const nlohmann::json hf_config =
      nlohmann::json::parse(ReadText(dir + "/config.json"));
  EXPECT_EQ(hf_config["torch_dtype"],
            dtype == DType::kFloat64 ? "float64" : "float32");
  EXPECT_EQ(hf_config["tie_word_embeddings"], tied);
  EXPECT_EQ(hf_config["num_key_value_heads"], 2);

  absl::StatusOr<CheckpointContents> contents =
      ReadCheckpoint(dir, /*read_optimizer=*/true);
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(contents->config, model->config());
  ASSERT_TRUE(contents->manifest.has_value());
  const CheckpointManifest& read = *contents->manifest;
  EXPECT_EQ(read.step, manifest.step);
  EXPECT_EQ(read.dtype, dtype);
  EXPECT_EQ(read.optimizer, OptimizerKind::kAdamW);
  EXPECT_EQ(read.optimizer_step_count, 1);
  EXPECT_EQ(read.default_adam.learning_rate,
            manifest.default_adam.learning_rate);
  EXPECT_EQ(read.default_adam.beta1, manifest.default_adam.beta1);
  EXPECT_EQ(read.default_adam.beta2, manifest.default_adam.beta2);
  EXPECT_EQ(read.default_adam.eps, manifest.default_adam.eps);
  EXPECT_EQ(read.default_adam.weight_decay, manifest.default_adam.weight_decay);
  EXPECT_EQ(read.default_max_grad_norm, manifest.default_max_grad_norm);
  EXPECT_EQ(read.tally_version, TALLY_VERSION);
  EXPECT_EQ(read.format_version, 1);

  // Every parameter under its HF name, in the model dtype; a tied model has
  // no lm_head.weight.
  ExpectBitwiseEqual(Snapshot(*model), contents->weights);
  bool has_lm_head = false;
  for (const auto& [name, tensor] : contents->weights) {
    has_lm_head |= name == "lm_head.weight";
  }
  EXPECT_EQ(has_lm_head, !tied);

  std::unique_ptr<LlamaModel> restored = MakeModel(tied, dtype, 2);
  ASSERT_TRUE(DiffersEverywhere(*restored, Snapshot(*model)));
  ASSERT_TRUE(LoadWeightsInto(*contents, *restored).ok());
  ExpectBitwiseEqual(Snapshot(*model), Snapshot(*restored));
  for (const Parameter& p : restored->parameters()) {
    EXPECT_TRUE(p.tensor.requires_grad()) << p.name;
  }

  Optimizer restored_optimizer(OptimizerKind::kAdamW, &restored->parameters());
  ASSERT_TRUE(
      restored_optimizer
          .LoadState(contents->optimizer_state, read.optimizer_step_count)
          .ok());
  ExpectBitwiseEqual(optimizer.StateTensors(),
                     restored_optimizer.StateTensors());
  EXPECT_GT(optimizer.StateTensors()[0].second.abs().sum().item<double>(), 0);

  // Resuming continues exactly where the original goes.
  SetFakeGradients(*model, 12);
  SetFakeGradients(*restored, 12);
  ASSERT_TRUE(optimizer.Step(AdamParams()).ok());
  ASSERT_TRUE(restored_optimizer.Step(AdamParams()).ok());
  ExpectBitwiseEqual(Snapshot(*model), Snapshot(*restored));
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndTying, CheckpointRoundTripTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat64),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<DType, bool>>& info) {
      return std::string(DTypeName(std::get<0>(info.param))) +
             (std::get<1>(info.param) ? "_tied" : "_untied");
    });

TEST_F(CheckpointTest, SgdWritesAnEmptyOptimizerFile) {
  const std::string dir = WriteFreshCheckpoint(false, OptimizerKind::kSgd);
  absl::StatusOr<NamedTensors> state =
      ReadSafetensors(dir + "/optimizer.safetensors");
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_TRUE(state->empty());
  absl::StatusOr<CheckpointContents> contents = ReadCheckpoint(dir, true);
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(contents->manifest->optimizer, OptimizerKind::kSgd);
  EXPECT_TRUE(contents->optimizer_state.empty());
}

TEST_F(CheckpointTest, SkipsOptimizerStateUnlessAsked) {
  const std::string dir = WriteFreshCheckpoint(false, OptimizerKind::kAdamW);
  absl::StatusOr<CheckpointContents> contents = ReadCheckpoint(dir, false);
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_TRUE(contents->optimizer_state.empty());
  contents = ReadCheckpoint(dir, true);
  ASSERT_TRUE(contents.ok()) << contents.status();
  // exp_avg and exp_avg_sq for each of the 2 + 2 * 9 + 1 parameters.
  EXPECT_EQ(contents->optimizer_state.size(), 2u * 21);
}

// A failed load must leave every parameter as it was.
class LoadFailureTest : public CheckpointTest {
 protected:
  void SetUp() override {
    CheckpointTest::SetUp();
    absl::StatusOr<CheckpointContents> contents = ReadCheckpoint(
        WriteFreshCheckpoint(false, OptimizerKind::kAdamW), false);
    ASSERT_TRUE(contents.ok()) << contents.status();
    contents_ = *std::move(contents);
    target_ = MakeModel(false, DType::kFloat32, 2);
    before_ = Snapshot(*target_);
    ASSERT_TRUE(DiffersEverywhere(*target_, contents_.weights));
  }

  void ExpectUnchanged() { ExpectBitwiseEqual(before_, Snapshot(*target_)); }

  torch::Tensor& Weight(const std::string& name) {
    for (auto& [n, t] : contents_.weights) {
      if (n == name) return t;
    }
    ADD_FAILURE() << "no weight " << name;
    return contents_.weights[0].second;
  }

  CheckpointContents contents_;
  std::unique_ptr<LlamaModel> target_;
  NamedTensors before_;
};

TEST_F(LoadFailureTest, ConfigMismatchNamesTheFirstField) {
  contents_.config.intermediate_size = 48;
  contents_.config.rope_theta = 500000.0;
  absl::Status status = LoadWeightsInto(contents_, *target_);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("config.intermediate_size is 48"));
  ExpectUnchanged();

  contents_.config.intermediate_size = 24;
  status = LoadWeightsInto(contents_, *target_);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("config.rope_theta"));
  ExpectUnchanged();
}

TEST_F(LoadFailureTest, MissingWeightIsNamed) {
  // The last weight: a non-atomic load would already have copied the rest.
  ASSERT_EQ(contents_.weights.back().first, "lm_head.weight");
  contents_.weights.pop_back();
  const absl::Status status = LoadWeightsInto(contents_, *target_);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("lm_head.weight"));
  ExpectUnchanged();
}

TEST_F(LoadFailureTest, MisshapedWeightIsNamed) {
  Weight("model.norm.weight") = torch::ones({15});
  const absl::Status status = LoadWeightsInto(contents_, *target_);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("model.norm.weight"));
  ExpectUnchanged();
}

TEST_F(LoadFailureTest, UnknownWeightIsNamed) {
  contents_.weights.emplace_back("model.layers.7.mlp.up_proj.weight",
                                 torch::ones({24, 16}));
  const absl::Status status = LoadWeightsInto(contents_, *target_);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("model.layers.7.mlp.up_proj.weight"));
  ExpectUnchanged();
}

TEST_F(LoadFailureTest, IntegerWeightIsRejected) {
  Weight("model.norm.weight") = torch::ones({16}, torch::kInt64);
  const absl::Status status = LoadWeightsInto(contents_, *target_);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("model.norm.weight"));
  ExpectUnchanged();
}

TEST_F(CheckpointTest, TiedModelIgnoresLmHeadAndRotaryBuffers) {
  std::unique_ptr<LlamaModel> source = MakeModel(true, DType::kFloat32, 1);
  CheckpointContents contents;
  contents.config = source->config();
  contents.weights = Snapshot(*source);
  contents.weights.emplace_back("lm_head.weight", torch::zeros({32, 16}));
  contents.weights.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq",
                                torch::ones({2}));
  std::unique_ptr<LlamaModel> target = MakeModel(true, DType::kFloat32, 2);
  const absl::Status status = LoadWeightsInto(contents, *target);
  ASSERT_TRUE(status.ok()) << status;
  ExpectBitwiseEqual(Snapshot(*source), Snapshot(*target));
}

TEST_F(CheckpointTest, LoadsPlainHfDirectoryCastingToModelDtype) {
  std::unique_ptr<LlamaModel> source = MakeModel(false, DType::kFloat32, 1);
  NamedTensors half_weights;
  for (const Parameter& p : source->parameters()) {
    half_weights.emplace_back(p.name, p.tensor.detach().to(torch::kBFloat16));
  }
  const std::string dir = PathOf("hf");
  fs::create_directories(dir);
  WriteText(dir + "/config.json", source->config().ToHfJson("bfloat16"));
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", half_weights,
                               {{"format", "pt"}})
                  .ok());

  absl::StatusOr<CheckpointContents> contents = ReadCheckpoint(dir, true);
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_FALSE(contents->manifest.has_value());
  EXPECT_TRUE(contents->optimizer_state.empty());
  std::unique_ptr<LlamaModel> target = MakeModel(false, DType::kFloat64, 2);
  ASSERT_TRUE(LoadWeightsInto(*contents, *target).ok());
  NamedTensors expected;
  for (const auto& [name, t] : half_weights) {
    expected.emplace_back(name, t.to(torch::kFloat64));
  }
  ExpectBitwiseEqual(expected, Snapshot(*target));
}

TEST_F(CheckpointTest, LoadsShardedHfDirectory) {
  std::unique_ptr<LlamaModel> source = MakeModel(false, DType::kFloat32, 1);
  const NamedTensors weights = Snapshot(*source);
  const std::string dir = PathOf("sharded");
  fs::create_directories(dir);
  WriteText(dir + "/config.json", source->config().ToHfJson("float32"));
  // Shard 1 holds the second half, shard 2 the first, so the index decides.
  const size_t half = weights.size() / 2;
  const NamedTensors first(weights.begin(), weights.begin() + half);
  const NamedTensors second(weights.begin() + half, weights.end());
  const std::string first_file = "model-00002-of-00002.safetensors";
  const std::string second_file = "model-00001-of-00002.safetensors";
  ASSERT_TRUE(WriteSafetensors(dir + "/" + first_file, first).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/" + second_file, second).ok());
  nlohmann::json index;
  index["metadata"]["total_size"] = 0;
  for (const auto& [name, t] : first) index["weight_map"][name] = first_file;
  for (const auto& [name, t] : second) index["weight_map"][name] = second_file;
  WriteText(dir + "/model.safetensors.index.json", index.dump());

  absl::StatusOr<CheckpointContents> contents = ReadCheckpoint(dir, false);
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(contents->weights.size(), weights.size());
  std::unique_ptr<LlamaModel> target = MakeModel(false, DType::kFloat32, 2);
  ASSERT_TRUE(LoadWeightsInto(*contents, *target).ok());
  ExpectBitwiseEqual(weights, Snapshot(*target));

  // A tensor the index promises but its shard lacks.
  index["weight_map"]["model.extra.weight"] = first_file;
  WriteText(dir + "/model.safetensors.index.json", index.dump());
  absl::Status status = ReadCheckpoint(dir, false).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("model.extra.weight"));

  // A shard path must stay inside the directory.
  index["weight_map"]["model.extra.weight"] = "../elsewhere.safetensors";
  WriteText(dir + "/model.safetensors.index.json", index.dump());
  status = ReadCheckpoint(dir, false).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("model.extra.weight"));
}

TEST_F(CheckpointTest, ReadErrorsNameTheProblem) {
  EXPECT_EQ(ReadCheckpoint(PathOf("absent"), true).status().code(),
            absl::StatusCode::kNotFound);

  const std::string dir = WriteFreshCheckpoint(false, OptimizerKind::kAdamW);
  const std::string config = ReadText(dir + "/config.json");
  const std::string manifest = ReadText(dir + "/tally.json");
  const std::string weights = ReadText(dir + "/model.safetensors");
  auto expect_error = [&](absl::StatusCode code, const std::string& needle) {
    const absl::Status status = ReadCheckpoint(dir, true).status();
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(needle));
  };

  fs::remove(dir + "/config.json");
  expect_error(absl::StatusCode::kInvalidArgument, dir + "/config.json");
  WriteText(dir + "/config.json", "{ not json");
  expect_error(absl::StatusCode::kInvalidArgument, dir + "/config.json");
  nlohmann::json wrong_type = nlohmann::json::parse(config);
  wrong_type["tie_word_embeddings"] = "yes";
  WriteText(dir + "/config.json", wrong_type.dump());
  expect_error(absl::StatusCode::kInvalidArgument, dir + "/config.json");
  WriteText(dir + "/config.json", config);

  WriteText(dir + "/tally.json", "[]");
  expect_error(absl::StatusCode::kDataLoss, dir + "/tally.json");
  nlohmann::json bad_manifest = nlohmann::json::parse(manifest);
  bad_manifest["optimizer"] = "lion";
  WriteText(dir + "/tally.json", bad_manifest.dump());
  expect_error(absl::StatusCode::kDataLoss, "optimizer");
  bad_manifest = nlohmann::json::parse(manifest);
  bad_manifest["default_adam"].erase("eps");
  WriteText(dir + "/tally.json", bad_manifest.dump());
  expect_error(absl::StatusCode::kDataLoss, "default_adam.eps");
  bad_manifest = nlohmann::json::parse(manifest);
  bad_manifest["format_version"] = 2;
  WriteText(dir + "/tally.json", bad_manifest.dump());
  expect_error(absl::StatusCode::kInvalidArgument, "format_version");
  WriteText(dir + "/tally.json", manifest);

  WriteText(dir + "/model.safetensors", weights.substr(0, weights.size() - 1));
  expect_error(absl::StatusCode::kDataLoss, dir + "/model.safetensors");
  fs::remove(dir + "/model.safetensors");
  expect_error(absl::StatusCode::kInvalidArgument, "model.safetensors");
  WriteText(dir + "/model.safetensors", weights);

  ASSERT_TRUE(ReadCheckpoint(dir, true).ok());
}

// An independent reader: numpy parses model.safetensors and prints per-tensor
// checksums that must match the tensors tally wrote.
std::string ChecksumScript() {
  const char* source_dir = std::getenv("TALLY_SOURCE_DIR");
  const fs::path root =
      source_dir != nullptr
          ? fs::path(source_dir)
          : fs::path(__FILE__).parent_path().parent_path().parent_path();
  return (root / "tests" / "python" / "safetensors_checksums.py").string();
}

class NumpyReadbackTest : public CheckpointTest,
                          public ::testing::WithParamInterface<DType> {};

TEST_P(NumpyReadbackTest, NumpyChecksumsMatch) {
  constexpr char kPython[] = "/usr/bin/python3";
  if (!fs::exists(kPython)) GTEST_SKIP() << kPython << " is not installed";
  const std::string script = ChecksumScript();
  ASSERT_TRUE(fs::exists(script)) << script;

  std::unique_ptr<LlamaModel> model = MakeModel(false, GetParam(), 5);
  Optimizer optimizer(OptimizerKind::kAdamW, &model->parameters());
  const std::string dir = PathOf("numpy");
  ASSERT_TRUE(WriteCheckpoint(dir, *model, optimizer, SampleManifest()).ok());

  const std::string command = std::string(kPython) + " '" + script + "' '" +
                              dir + "/model.safetensors' 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) {
    output.append(buffer, n);
  }
  ASSERT_EQ(pclose(pipe), 0) << output;

  std::vector<std::string> lines =
      absl::StrSplit(output, '\n', absl::SkipEmpty());
  const std::vector<Parameter>& parameters = model->parameters();
  ASSERT_EQ(lines.size(), parameters.size() + 1) << output;
  EXPECT_EQ(lines[0], "__metadata__\t{\"format\": \"pt\"}");
  const std::string dtype_code = GetParam() == DType::kFloat64 ? "F64" : "F32";
  for (size_t i = 0; i < parameters.size(); ++i) {
    const Parameter& p = parameters[i];
    SCOPED_TRACE(p.name);
    const std::vector<std::string> fields = absl::StrSplit(lines[i + 1], '\t');
    ASSERT_EQ(fields.size(), 5u) << lines[i + 1];
    EXPECT_EQ(fields[0], p.name);
    EXPECT_EQ(fields[1], dtype_code);
    EXPECT_EQ(fields[2], absl::StrJoin(p.tensor.sizes(), ","));

    const torch::Tensor values =
        p.tensor.detach().flatten().to(torch::kFloat64);
    const torch::Tensor weighted =
        values * torch::arange(1, values.numel() + 1, torch::kFloat64);
    // Summation order differs between numpy and torch; float64 sums of these
    // few hundred values agree far within this bound.
    EXPECT_NEAR(std::stod(fields[3]), values.sum().item<double>(),
                1e-12 * values.abs().sum().item<double>());
    EXPECT_NEAR(std::stod(fields[4]), weighted.sum().item<double>(),
                1e-12 * weighted.abs().sum().item<double>());
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NumpyReadbackTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat64),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace tally
