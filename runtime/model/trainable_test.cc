// Frozen parameters (Parameter::trainable = false, ModelSpec::frozen): they
// take no gradient, no optimizer state, no step and no slot in the norm, and
// a trainable-only checkpoint holds everything else. Checked against the same
// model with nothing frozen: freezing changes nothing for the rest.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "runtime/checkpoint/checkpoint.h"
#include "runtime/engine/engine.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;
using testing::MakeSamples;
using testing::TinySpec;

constexpr int64_t kVocab = 48;
// The embedding and every layer's query projection.
const std::vector<std::string> kFrozen = {
    "model.embed_tokens.weight", "model.layers.*.self_attn.q_proj.weight"};

bool IsFrozen(const std::string& name) {
  return name == "model.embed_tokens.weight" ||
         name.find("self_attn.q_proj") != std::string::npos;
}

class TrainableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = Engine::CreateSingleRank({}).value();
    ModelSpec all = TinySpec("all", DType::kFloat64, OptimizerKind::kAdamW);
    ModelSpec frozen = all;
    frozen.model_id = "frozen";
    frozen.frozen = kFrozen;
    ASSERT_TRUE(engine_->CreateModel(all).ok());
    ASSERT_TRUE(engine_->CreateModel(frozen).ok());
  }

  // One window on both models; returns the two steps.
  std::pair<OptimStepResult, OptimStepResult> TrainBoth() {
    OptimStepArgs args;
    args.max_grad_norm = 0;  // report the norm, never clip
    std::vector<OptimStepResult> steps;
    for (const char* id : {"all", "frozen"}) {
      EXPECT_TRUE(
          engine_->ForwardBackward(id, {MakeSamples(kVocab, {5, 3}, 9)}).ok());
      steps.push_back(engine_->OptimStep(id, args).value());
    }
    return {steps[0], steps[1]};
  }

  CausalLm& model(const std::string& id) {
    return *EngineTestPeer::Model(*engine_, id).value();
  }

  std::unique_ptr<Engine> engine_;
};

TEST_F(TrainableTest, FrozenParametersTakeNoGradientAndTheRestIsUnchanged) {
  ASSERT_TRUE(
      engine_->ForwardBackward("all", {MakeSamples(kVocab, {5, 3}, 9)}).ok());
  ASSERT_TRUE(
      engine_->ForwardBackward("frozen", {MakeSamples(kVocab, {5, 3}, 9)})
          .ok());
  const std::vector<Parameter>& all = model("all").parameters();
  const std::vector<Parameter>& frozen = model("frozen").parameters();
  ASSERT_EQ(all.size(), frozen.size());
  int frozen_count = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(all[i].name, frozen[i].name);
    EXPECT_EQ(frozen[i].trainable, !IsFrozen(frozen[i].name)) << all[i].name;
    if (IsFrozen(all[i].name)) {
      ++frozen_count;
      EXPECT_FALSE(frozen[i].tensor.requires_grad()) << all[i].name;
      EXPECT_FALSE(frozen[i].tensor.grad().defined()) << all[i].name;
      continue;
    }
    ASSERT_TRUE(frozen[i].tensor.grad().defined()) << all[i].name;
    EXPECT_LT(
        testing::RelativeDiff(frozen[i].tensor.grad(), all[i].tensor.grad()),
        1e-12)
        << all[i].name;
  }
  EXPECT_EQ(frozen_count, 1 + testing::TinyConfig().num_hidden_layers);
}

TEST_F(TrainableTest, TheNormCountsAndTheStepMovesOnlyTrainableParameters) {
  const std::vector<torch::Tensor> before =
      testing::ParameterValues(model("frozen"));
  // The frozen parameters' share of the unfrozen model's squared norm.
  ASSERT_TRUE(
      engine_->ForwardBackward("all", {MakeSamples(kVocab, {5, 3}, 9)}).ok());
  double frozen_raw_squares = 0;
  for (const Parameter& p : model("all").parameters()) {
    if (IsFrozen(p.name)) {
      frozen_raw_squares += p.tensor.grad().pow(2).sum().item<double>();
    }
  }
  ASSERT_TRUE(engine_->AbortAccumulation("all").ok());
  const auto [all_step, frozen_step] = TrainBoth();
  ASSERT_EQ(all_step.normalizer, frozen_step.normalizer);
  const double frozen_squares =
      frozen_raw_squares / (all_step.normalizer * all_step.normalizer);
  ASSERT_GT(frozen_squares, 0);
  EXPECT_LT(testing::RelativeDiff(
                frozen_step.grad_norm * frozen_step.grad_norm,
                all_step.grad_norm * all_step.grad_norm - frozen_squares),
            1e-10);
  const std::vector<Parameter>& params = model("frozen").parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(torch::equal(params[i].tensor, before[i]),
              IsFrozen(params[i].name))
        << params[i].name;
  }
  std::set<std::string> state;
  for (const auto& [name, t] : EngineTestPeer::OptimizerOf(*engine_, "frozen")
                                   .value()
                                   ->StateTensors()) {
    state.insert(name.substr(0, name.rfind('.')));
  }
  for (const Parameter& p : params) {
    EXPECT_EQ(state.count(p.name), p.trainable ? 1u : 0u) << p.name;
  }
}

TEST_F(TrainableTest, ATrainableOnlyCheckpointLeavesTheFrozenBaseAlone) {
  TrainBoth();
  const std::string dir = ::testing::TempDir() + "trainable_only_ckpt";
  std::filesystem::remove_all(dir);
  SaveOptions options;
  options.trainable_only = true;
  ASSERT_TRUE(engine_->SaveCheckpoint("frozen", dir, options).ok());

  const CheckpointContents contents = ReadCheckpoint(dir, true).value();
  ASSERT_TRUE(contents.manifest.has_value());
  EXPECT_TRUE(contents.manifest->trainable_only);
  for (const auto& [name, t] : contents.weights) {
    EXPECT_FALSE(IsFrozen(name)) << name;
  }
  EXPECT_EQ(contents.weights.size(),
            model("frozen").parameters().size() -
                (1 + testing::TinyConfig().num_hidden_layers));

  // A fresh model with the same parameters frozen takes the trainable ones
  // and keeps its own frozen base.
  ModelSpec fresh = TinySpec("fresh", DType::kFloat64, OptimizerKind::kAdamW,
                             /*seed=*/77);
  fresh.frozen = kFrozen;
  ASSERT_TRUE(engine_->CreateModel(fresh).ok());
  const std::vector<torch::Tensor> fresh_before =
      testing::ParameterValues(model("fresh"));
  const absl::StatusOr<LoadResult> loaded =
      engine_->LoadCheckpoint("fresh", dir, /*load_optimizer=*/true);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::vector<Parameter>& got = model("fresh").parameters();
  const std::vector<Parameter>& saved = model("frozen").parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(torch::equal(got[i].tensor, IsFrozen(got[i].name)
                                                ? fresh_before[i]
                                                : saved[i].tensor))
        << got[i].name;
  }

  // A model that trains the embedding needs it from the checkpoint.
  ModelSpec trains_embedding =
      TinySpec("trains_embedding", DType::kFloat64, OptimizerKind::kAdamW);
  ASSERT_TRUE(engine_->CreateModel(trains_embedding).ok());
  const absl::Status refused =
      engine_->LoadCheckpoint("trains_embedding", dir, false).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("model.embed_tokens.weight is missing"));
}

TEST_F(TrainableTest, AFrozenPatternMustMatchAParameter) {
  ModelSpec spec = TinySpec("typo", DType::kFloat64, OptimizerKind::kAdamW);
  spec.frozen = {"model.layers.*.self_attn.q_prj.weight"};
  const absl::Status status = engine_->CreateModel(spec).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("frozen: 'model.layers.*.self_attn.q_prj.weight'"));
  EXPECT_FALSE(engine_->GetModel("typo").ok());
}

}  // namespace
}  // namespace tally
