#include "runtime/checkpoint/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
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
#include "runtime/io/atomic_directory.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/llama_model.h"
#include "runtime/train/optimizer.h"
#include "server/checkpoint_retention.h"
#include "tests/testing/test_util.h"

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
void SetFakeGradients(CausalLm& model, uint64_t seed) {
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

NamedTensors Snapshot(const CausalLm& model) {
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
bool DiffersEverywhere(const CausalLm& model, const NamedTensors& snapshot) {
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

// Rewrites checksums.sha256 to match the files as they are now, so a test
// can reach the parsing checks behind the checksum check.
void Reseal(const std::string& dir) {
  std::string sums;
  for (const char* file :
       {"config.json", "model.safetensors", "optimizer.safetensors",
        "server_state.bin", "tally.json"}) {
    const std::string path = dir + "/" + file;
    if (!fs::exists(path)) continue;
    absl::StatusOr<std::string> digest = Sha256OfFile(path);
    ASSERT_TRUE(digest.ok()) << digest.status();
    sums += *digest + "  " + file + "\n";
  }
  WriteText(dir + "/checksums.sha256", sums);
}

CheckpointManifest SampleManifest() {
  CheckpointManifest m;
  m.step = 1;
  m.seed = 987654321987654321u;
  m.grad_sync = GradSync::kDeferred;
  m.unsaved_window = {3, 40, 5, std::nullopt};
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
  // Every byte value, so nothing in the path may treat it as text.
  std::string server_state;
  for (int i = 0; i < 512; ++i) server_state += static_cast<char>(i % 256);
  absl::StatusOr<uint64_t> bytes =
      WriteCheckpoint(dir, *model, optimizer, manifest, server_state);
  ASSERT_TRUE(bytes.ok()) << bytes.status();

  std::set<std::string> files;
  uint64_t bytes_on_disk = 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    files.insert(entry.path().filename().string());
    bytes_on_disk += entry.file_size();
  }
  EXPECT_EQ(files,
            (std::set<std::string>{"config.json", "model.safetensors",
                                   "optimizer.safetensors", "server_state.bin",
                                   "tally.json", "checksums.sha256"}));
  EXPECT_EQ(*bytes, bytes_on_disk);
  // Nothing but the checkpoint is left next to it.
  EXPECT_EQ(std::distance(fs::directory_iterator(PathOf("nested")),
                          fs::directory_iterator()),
            1);

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
  EXPECT_EQ(read.grad_sync, GradSync::kDeferred);
  EXPECT_EQ(read.seed, manifest.seed);
  EXPECT_EQ(read.unsaved_window.calls, 3);
  EXPECT_EQ(read.unsaved_window.tokens, 40);
  EXPECT_EQ(read.unsaved_window.samples, 5);
  EXPECT_EQ(read.tally_version, TALLY_VERSION);
  EXPECT_EQ(read.format_version, 2);
  EXPECT_EQ(contents->server_state, server_state);

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

// Moments a hostile or damaged file made non-finite, or a negative second
// moment (its square root is NaN), would keep their parameters from ever
// training again: the load is refused naming the tensor, and the state the
// optimizer had is kept.
TEST(OptimizerLoadStateTest, NonFiniteOrNegativeMomentsAreRefused) {
  std::unique_ptr<LlamaModel> model = MakeModel(false, DType::kFloat32, 1);
  Optimizer optimizer(OptimizerKind::kAdamW, &model->parameters());
  SetFakeGradients(*model, 2);
  ASSERT_TRUE(optimizer.Step(AdamParams()).ok());
  std::vector<std::pair<std::string, torch::Tensor>> before;
  for (const auto& [name, t] : optimizer.StateTensors()) {
    before.emplace_back(name, t.clone());
  }
  const std::pair<const char*, float> cases[] = {{".exp_avg", std::nanf("")},
                                                 {".exp_avg", INFINITY},
                                                 {".exp_avg_sq", -INFINITY},
                                                 {".exp_avg_sq", -1e-30f}};
  for (const auto& [suffix, value] : cases) {
    SCOPED_TRACE(::testing::Message() << suffix << " " << value);
    std::vector<std::pair<std::string, torch::Tensor>> hostile;
    for (const auto& [name, t] : before) hostile.emplace_back(name, t.clone());
    const std::string target = "model.norm.weight" + std::string(suffix);
    bool found = false;
    for (auto& [name, t] : hostile) {
      if (name != target) continue;
      t.view(-1)[3] = value;
      found = true;
    }
    ASSERT_TRUE(found);
    const absl::Status status = optimizer.LoadState(hostile, 7);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("optimizer state " + target + " holds a"));
    ExpectBitwiseEqual(before, optimizer.StateTensors());
    EXPECT_EQ(optimizer.step_count(), 1);
  }
  // The same state without the bad value loads.
  EXPECT_TRUE(optimizer.LoadState(before, 7).ok());
  EXPECT_EQ(optimizer.step_count(), 7);
}

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
  // Each tampered file is resealed: these are the checks behind the checksums.
  auto write_sealed = [&](const std::string& file, const std::string& text) {
    WriteText(dir + "/" + file, text);
    Reseal(dir);
  };

  fs::remove(dir + "/config.json");
  Reseal(dir);
  expect_error(absl::StatusCode::kInvalidArgument, dir + "/config.json");
  write_sealed("config.json", "{ not json");
  expect_error(absl::StatusCode::kInvalidArgument, dir + "/config.json");
  nlohmann::json wrong_type = nlohmann::json::parse(config);
  wrong_type["tie_word_embeddings"] = "yes";
  write_sealed("config.json", wrong_type.dump());
  expect_error(absl::StatusCode::kInvalidArgument, dir + "/config.json");
  write_sealed("config.json", config);

  write_sealed("tally.json", "[]");
  expect_error(absl::StatusCode::kDataLoss, dir + "/tally.json");
  nlohmann::json bad_manifest = nlohmann::json::parse(manifest);
  bad_manifest["optimizer"] = "lion";
  write_sealed("tally.json", bad_manifest.dump());
  expect_error(absl::StatusCode::kDataLoss, "optimizer");
  bad_manifest = nlohmann::json::parse(manifest);
  bad_manifest["default_adam"].erase("eps");
  write_sealed("tally.json", bad_manifest.dump());
  expect_error(absl::StatusCode::kDataLoss, "default_adam.eps");
  bad_manifest = nlohmann::json::parse(manifest);
  bad_manifest["unsaved_window"].erase("tokens");
  write_sealed("tally.json", bad_manifest.dump());
  expect_error(absl::StatusCode::kDataLoss, "unsaved_window.tokens");
  bad_manifest = nlohmann::json::parse(manifest);
  bad_manifest["format_version"] = 3;
  write_sealed("tally.json", bad_manifest.dump());
  expect_error(absl::StatusCode::kInvalidArgument, "format_version");
  write_sealed("tally.json", manifest);

  write_sealed("model.safetensors", weights.substr(0, weights.size() - 1));
  expect_error(absl::StatusCode::kDataLoss, dir + "/model.safetensors");
  fs::remove(dir + "/model.safetensors");
  Reseal(dir);
  expect_error(absl::StatusCode::kInvalidArgument, "model.safetensors");
  write_sealed("model.safetensors", weights);

  const absl::Status restored = ReadCheckpoint(dir, true).status();
  EXPECT_TRUE(restored.ok()) << restored;
}

// JSON nested far deeper than nlohmann's recursive copy and dump() can go,
// in each JSON file of a checkpoint: refused by the depth limit, naming the
// file and the field, with a short message (no crash, no echo of the value).
TEST_F(CheckpointTest, DeeplyNestedJsonIsRefusedNamingTheFileAndField) {
  const std::string dir = WriteFreshCheckpoint(false, OptimizerKind::kAdamW);
  const std::string config = ReadText(dir + "/config.json");
  const std::string manifest = ReadText(dir + "/tally.json");
  fs::remove(dir + "/checksums.sha256");
  auto expect_refused = [&](absl::StatusCode code, const std::string& file,
                            const std::string& where) {
    const absl::Status status = ReadCheckpoint(dir, false).status();
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(dir + "/" + file));
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("deeper than 64 levels (at " + where));
    EXPECT_LE(status.message().size(), 600u);
  };

  // An unknown field of config.json, which a weights export carries over.
  std::string deep = config;
  deep.insert(deep.rfind('}'), R"(, "extra": )" + std::string(300000, '[') +
                                   std::string(300000, ']'));
  WriteText(dir + "/config.json", deep);
  expect_refused(absl::StatusCode::kInvalidArgument, "config.json",
                 "extra[][]");
  WriteText(dir + "/config.json", config);

  deep = manifest;
  deep.insert(deep.rfind('}'), R"(, "lora": {"rank": )" +
                                   std::string(100000, '[') +
                                   std::string(100000, ']') + "}");
  WriteText(dir + "/tally.json", deep);
  expect_refused(absl::StatusCode::kDataLoss, "tally.json", "lora.rank[][]");
  fs::remove(dir + "/tally.json");

  fs::rename(dir + "/model.safetensors", dir + "/model-1.safetensors");
  WriteText(dir + "/model.safetensors.index.json",
            R"({"weight_map":{"a":)" + std::string(100000, '[') +
                std::string(100000, ']') + "}}");
  expect_refused(absl::StatusCode::kDataLoss, "model.safetensors.index.json",
                 "weight_map.a[][]");
}

// A header declaring a 64 GiB tensor for a model of ~4k parameters is
// refused from the header alone, naming the tensor and its expected shape:
// nothing of its size is allocated (before, the read failed allocating, or
// with a smaller tensor held gigabytes until the shape check after it).
TEST_F(CheckpointTest, TensorsAreCheckedAgainstTheConfigBeforeAllocating) {
  const std::string dir = WriteFreshCheckpoint(false, OptimizerKind::kAdamW);
  nlohmann::json manifest =
      nlohmann::json::parse(ReadText(dir + "/tally.json"));
  manifest["format_version"] = 1;  // no checksums: the hole is never hashed
  WriteText(dir + "/tally.json", manifest.dump());
  fs::remove(dir + "/checksums.sha256");
  const std::string weights = ReadText(dir + "/model.safetensors");
  const std::string optimizer = ReadText(dir + "/optimizer.safetensors");
  auto expect_refused = [&](const std::string& file,
                            const std::string& needle) {
    const absl::Status status = ReadCheckpoint(dir, true).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(dir + "/" + file));
    EXPECT_THAT(std::string(status.message()), HasSubstr(needle));
  };
  const std::vector<int64_t> huge = {int64_t{1} << 24, 1024};  // 64 GiB

  ASSERT_TRUE(testing::WriteSparseSafetensors(
      dir + "/model.safetensors", "model.embed_tokens.weight", huge));
  expect_refused("model.safetensors",
                 "checkpoint weight model.embed_tokens.weight has shape "
                 "[16777216, 1024], expected [32, 16]");
  ASSERT_TRUE(testing::WriteSparseSafetensors(dir + "/model.safetensors",
                                              "model.extra.weight", huge));
  expect_refused("model.safetensors",
                 "checkpoint weight model.extra.weight is not a parameter");
  WriteText(dir + "/model.safetensors", weights);

  ASSERT_TRUE(testing::WriteSparseSafetensors(
      dir + "/optimizer.safetensors", "model.norm.weight.exp_avg", huge));
  expect_refused("optimizer.safetensors",
                 "optimizer state model.norm.weight.exp_avg has shape "
                 "[16777216, 1024], expected [16]");
  WriteText(dir + "/optimizer.safetensors", optimizer);

  const absl::Status restored = ReadCheckpoint(dir, true).status();
  EXPECT_TRUE(restored.ok()) << restored;
}

// Every file of a checkpoint is covered: one flipped byte or a lost tail in
// any of them is DATA_LOSS naming that file.
TEST_F(CheckpointTest, CorruptOrTruncatedFilesAreDataLossNamingTheFile) {
  const std::string dir = WriteFreshCheckpoint(false, OptimizerKind::kAdamW);
  ASSERT_TRUE(ReadCheckpoint(dir, true).ok());
  for (const char* file : {"config.json", "model.safetensors",
                           "optimizer.safetensors", "tally.json"}) {
    const std::string path = dir + "/" + file;
    const std::string original = ReadText(path);
    ASSERT_GT(original.size(), 2u) << file;
    std::string flipped = original;
    flipped[flipped.size() / 2] ^= 0x01;
    for (const std::string& damaged :
         {flipped, original.substr(0, original.size() - 1)}) {
      WriteText(path, damaged);
      const absl::Status status = ReadCheckpoint(dir, true).status();
      EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << file;
      EXPECT_THAT(std::string(status.message()), HasSubstr(path));
      EXPECT_EQ(VerifyCheckpoint(dir).status().code(),
                absl::StatusCode::kDataLoss)
          << file;
    }
    WriteText(path, original);
  }
  ASSERT_TRUE(ReadCheckpoint(dir, true).ok());

  // server_state.bin is empty here: an appended byte is the damage.
  WriteText(dir + "/server_state.bin", "x");
  EXPECT_EQ(ReadCheckpoint(dir, true).status().code(),
            absl::StatusCode::kDataLoss);
  WriteText(dir + "/server_state.bin", "");

  const std::string sums = ReadText(dir + "/checksums.sha256");
  fs::remove(dir + "/optimizer.safetensors");  // listed but missing
  EXPECT_THAT(std::string(ReadCheckpoint(dir, false).status().message()),
              HasSubstr("optimizer.safetensors"));
  fs::remove(dir + "/checksums.sha256");  // a format-2 checkpoint needs it
  EXPECT_THAT(std::string(ReadCheckpoint(dir, false).status().message()),
              HasSubstr("checksums.sha256"));
  EXPECT_EQ(ReadCheckpoint(dir, false).status().code(),
            absl::StatusCode::kDataLoss);
}

// checksums.sha256 is in `sha256sum` format, so coreutils checks it
// independently of tally's reader.
TEST_F(CheckpointTest, ChecksumsVerifyWithSha256sum) {
  if (std::system("command -v sha256sum > /dev/null") != 0) {
    GTEST_SKIP() << "sha256sum is not installed";
  }
  const std::string dir = WriteFreshCheckpoint(true, OptimizerKind::kAdamW);
  const std::string check =
      "cd '" + dir + "' && sha256sum --check --strict --quiet checksums.sha256";
  EXPECT_EQ(std::system(check.c_str()), 0);
  std::string weights = ReadText(dir + "/model.safetensors");
  weights.back() ^= 0x01;
  WriteText(dir + "/model.safetensors", weights);
  EXPECT_NE(std::system((check + " 2> /dev/null").c_str()), 0);
}

TEST_F(CheckpointTest, FormatOneCheckpointsWithoutChecksumsStillLoad) {
  const std::string dir = WriteFreshCheckpoint(false, OptimizerKind::kAdamW);
  nlohmann::json manifest =
      nlohmann::json::parse(ReadText(dir + "/tally.json"));
  manifest["format_version"] = 1;
  for (const char* added : {"grad_sync", "seed", "unsaved_window"}) {
    manifest.erase(added);
  }
  WriteText(dir + "/tally.json", manifest.dump());
  fs::remove(dir + "/checksums.sha256");
  fs::remove(dir + "/server_state.bin");
  absl::StatusOr<CheckpointContents> contents = ReadCheckpoint(dir, true);
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(contents->manifest->format_version, 1);
  EXPECT_EQ(contents->optimizer_state.size(), 2u * 21);
}

// A save over an existing checkpoint replaces it whole and leaves no staging
// or previous directory behind.
TEST_F(CheckpointTest, SaveReplacesAnExistingCheckpoint) {
  for (bool exchange : {true, false}) {
    SCOPED_TRACE(exchange ? "RENAME_EXCHANGE" : "two renames");
    SetPublishTestHooks({nullptr, exchange});
    const std::string dir = PathOf(exchange ? "a" : "b");
    std::unique_ptr<LlamaModel> first = MakeModel(false, DType::kFloat32, 1);
    std::unique_ptr<LlamaModel> second = MakeModel(false, DType::kFloat32, 2);
    Optimizer optimizer(OptimizerKind::kSgd, &first->parameters());
    ASSERT_TRUE(WriteCheckpoint(dir, *first, optimizer, {}, "one").ok());
    ASSERT_TRUE(WriteCheckpoint(dir, *second, optimizer, {}, "two").ok());
    absl::StatusOr<CheckpointContents> contents = ReadCheckpoint(dir, true);
    ASSERT_TRUE(contents.ok()) << contents.status();
    ExpectBitwiseEqual(Snapshot(*second), contents->weights);
    EXPECT_EQ(contents->server_state, "two");
  }
  SetPublishTestHooks({});
  std::set<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(root_)) {
    names.insert(entry.path().filename().string());
  }
  EXPECT_EQ(names, (std::set<std::string>{"a", "b"}));
}

// Replacing deletes the old directory, so only a checkpoint (or nothing) is
// ever replaced.
TEST_F(CheckpointTest, RefusesToReplaceWhatIsNotACheckpoint) {
  std::unique_ptr<LlamaModel> model = MakeModel(false, DType::kFloat32, 1);
  Optimizer optimizer(OptimizerKind::kSgd, &model->parameters());
  const std::string data = PathOf("data");
  fs::create_directories(data);
  WriteText(data + "/notes.txt", "precious");
  WriteText(PathOf("file"), "precious");
  for (const std::string& target : {data, PathOf("file")}) {
    const absl::Status status =
        WriteCheckpoint(target, *model, optimizer, {}).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  }
  EXPECT_EQ(ReadText(data + "/notes.txt"), "precious");
  EXPECT_EQ(ReadText(PathOf("file")), "precious");
  fs::create_directories(PathOf("empty"));
  EXPECT_TRUE(WriteCheckpoint(PathOf("empty"), *model, optimizer, {}).ok());
}

// A failure at any step of the protocol leaves the previous checkpoint
// readable under its name, and the failed attempt leaves nothing behind.
TEST_F(CheckpointTest, FailedSaveLeavesThePreviousCheckpoint) {
  std::unique_ptr<LlamaModel> old_model = MakeModel(false, DType::kFloat32, 1);
  std::unique_ptr<LlamaModel> new_model = MakeModel(false, DType::kFloat32, 2);
  Optimizer optimizer(OptimizerKind::kAdamW, &old_model->parameters());
  const std::string dir = PathOf("ckpt");
  ASSERT_TRUE(WriteCheckpoint(dir, *old_model, optimizer, {}, "old").ok());
  for (bool exchange : {true, false}) {
    for (const char* failing : kCheckpointWriteStages) {
      const std::string stage = failing;
      // Failures after the commit point leave the new checkpoint.
      if (stage == "exchanged" || stage == "published" ||
          stage == "removed previous") {
        continue;
      }
      SCOPED_TRACE(stage + (exchange ? "" : " (two renames)"));
      SetPublishTestHooks({[&](absl::string_view reached) {
                             return reached == stage
                                        ? absl::UnavailableError("injected")
                                        : absl::OkStatus();
                           },
                           exchange});
      const absl::Status saved =
          WriteCheckpoint(dir, *new_model, optimizer, {}, "new").status();
      const bool reachable = exchange ? stage != "moved previous aside" : true;
      if (reachable) {
        EXPECT_EQ(saved.code(), absl::StatusCode::kUnavailable) << saved;
      } else {
        EXPECT_TRUE(saved.ok()) << saved;
        SetPublishTestHooks({});
        ASSERT_TRUE(
            WriteCheckpoint(dir, *old_model, optimizer, {}, "old").ok());
        continue;
      }
      absl::StatusOr<CheckpointContents> contents = ReadCheckpoint(dir, true);
      ASSERT_TRUE(contents.ok()) << contents.status();
      ExpectBitwiseEqual(Snapshot(*old_model), contents->weights);
      EXPECT_EQ(contents->server_state, "old");
      EXPECT_EQ(std::distance(fs::directory_iterator(root_),
                              fs::directory_iterator()),
                1);
    }
  }
  SetPublishTestHooks({});
}

// The crash test: a child process writes a new checkpoint over an old one
// and dies (_exit, no cleanup, like kill -9) right after a given step. Before
// the commit point the old checkpoint reads back whole; from it on, the new
// one; never anything else. The next save cleans up after the crash.
TEST_F(CheckpointTest, CrashAtAnyStepLeavesAWholeCheckpoint) {
  std::unique_ptr<LlamaModel> old_model = MakeModel(true, DType::kFloat64, 1);
  std::unique_ptr<LlamaModel> new_model = MakeModel(true, DType::kFloat64, 2);
  Optimizer optimizer(OptimizerKind::kAdamW, &old_model->parameters());
  constexpr int kCrashed = 42;
  for (bool exchange : {true, false}) {
    bool committed = false;
    for (const char* crash_stage : kCheckpointWriteStages) {
      const std::string stage = crash_stage;
      SCOPED_TRACE(stage + (exchange ? "" : " (two renames)"));
      const std::string dir = PathOf("ckpt");
      SetPublishTestHooks({});
      ASSERT_TRUE(WriteCheckpoint(dir, *old_model, optimizer, {}, "old").ok());

      const pid_t child = fork();
      ASSERT_GE(child, 0);
      if (child == 0) {
        SetPublishTestHooks({[&](absl::string_view reached) {
                               if (reached == stage) _exit(kCrashed);
                               return absl::OkStatus();
                             },
                             exchange});
        const bool ok =
            WriteCheckpoint(dir, *new_model, optimizer, {}, "new").ok();
        _exit(ok ? 0 : 1);
      }
      int wait_status = 0;
      ASSERT_EQ(waitpid(child, &wait_status, 0), child);
      ASSERT_TRUE(WIFEXITED(wait_status));
      const int code = WEXITSTATUS(wait_status);
      // A stage of the other mode is never reached: the save completes.
      ASSERT_TRUE(code == kCrashed || code == 0) << code;
      committed |= stage == (exchange ? "exchanged" : "published");
      const bool expect_new = code == 0 || committed;

      absl::StatusOr<CheckpointContents> contents = ReadCheckpoint(dir, true);
      ASSERT_TRUE(contents.ok()) << contents.status();
      ExpectBitwiseEqual(Snapshot(expect_new ? *new_model : *old_model),
                         contents->weights);
      EXPECT_EQ(contents->server_state, expect_new ? "new" : "old");
      EXPECT_TRUE(VerifyCheckpoint(dir).ok());

      // The next save recovers: it publishes and leaves only the checkpoint.
      ASSERT_TRUE(WriteCheckpoint(dir, *old_model, optimizer, {}, "old").ok());
      EXPECT_EQ(std::distance(fs::directory_iterator(root_),
                              fs::directory_iterator()),
                1);
      fs::remove_all(dir);
    }
    EXPECT_TRUE(committed);
  }
  SetPublishTestHooks({});
}

TEST_F(CheckpointTest, StepCheckpointsListNewestFirstAndPrune) {
  std::unique_ptr<LlamaModel> model = MakeModel(false, DType::kFloat32, 1);
  Optimizer optimizer(OptimizerKind::kSgd, &model->parameters());
  const std::string model_dir = PathOf("models/m");
  for (int64_t step : {3, 12, 6, 9}) {
    ASSERT_TRUE(WriteCheckpoint(StepCheckpointDir(model_dir, step), *model,
                                optimizer, {})
                    .ok());
  }
  EXPECT_EQ(StepCheckpointDir(model_dir, 12), model_dir + "/step-000000000012");
  fs::create_directories(model_dir + "/.step-000000000015.staging-1-0");
  fs::create_directories(model_dir + "/notes");
  EXPECT_EQ(
      ListStepCheckpoints(model_dir),
      (std::vector<std::string>{
          StepCheckpointDir(model_dir, 12), StepCheckpointDir(model_dir, 9),
          StepCheckpointDir(model_dir, 6), StepCheckpointDir(model_dir, 3)}));
  ASSERT_TRUE(PruneStepCheckpoints(model_dir, 2).ok());
  std::set<std::string> left;
  for (const fs::directory_entry& entry : fs::directory_iterator(model_dir)) {
    left.insert(entry.path().filename().string());
  }
  EXPECT_EQ(left, (std::set<std::string>{"step-000000000012",
                                         "step-000000000009", "notes"}));
  EXPECT_TRUE(ListStepCheckpoints(PathOf("absent")).empty());
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
