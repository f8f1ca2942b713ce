// Window poisoning: a ForwardBackward that fails after it may have added
// gradients, or a window the server reports incomplete, makes the next
// OptimStep ABORTED with nothing changed until AbortAccumulation; requests
// rejected by validation poison nothing. An OptimStep that fails after it may
// have updated some parameters damages the model until a LoadCheckpoint.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>

#include "runtime/engine/engine.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;
using testing::MakeSamples;
using testing::ParameterValues;
using testing::TinySpec;

constexpr int64_t kVocab = 48;

class EnginePoisonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = Engine::CreateSingleRank({}).value();
    ASSERT_EQ(testing::TinyConfig().vocab_size, kVocab);
    ASSERT_TRUE(
        engine_
            ->CreateModel(TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW))
            .ok());
  }
  CausalLm& model() { return *EngineTestPeer::Model(*engine_, "m").value(); }
  absl::Status Train(uint64_t seed,
                     LossReduction reduction = LossReduction::kTokenMean) {
    return engine_
        ->ForwardBackward("m", {MakeSamples(kVocab, {4, 7}, seed), reduction})
        .status();
  }
  bool Poisoned() { return engine_->WindowPoisoned("m").value(); }

  // OptimStep must be ABORTED naming `reason` and leave weights and step.
  void ExpectStepAborted(const std::string& reason) {
    const std::vector<torch::Tensor> before = ParameterValues(model());
    const absl::Status stepped = engine_->OptimStep("m", {}).status();
    EXPECT_EQ(stepped.code(), absl::StatusCode::kAborted) << stepped;
    EXPECT_THAT(std::string(stepped.message()), HasSubstr(reason));
    EXPECT_THAT(std::string(stepped.message()), HasSubstr("AbortAccumulation"));
    const std::vector<torch::Tensor> after = ParameterValues(model());
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(torch::equal(after[i], before[i])) << "parameter " << i;
    }
    EXPECT_EQ(engine_->GetModel("m")->step, 0);
  }

  // After AbortAccumulation the model trains normally again.
  void ExpectAbortHeals() {
    ASSERT_TRUE(engine_->AbortAccumulation("m").ok());
    EXPECT_FALSE(Poisoned());
    ASSERT_TRUE(Train(3).ok());
    const absl::StatusOr<OptimStepResult> stepped = engine_->OptimStep("m", {});
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    EXPECT_EQ(engine_->GetModel("m")->step, 1);
  }

  std::unique_ptr<Engine> engine_;
};

TEST_F(EnginePoisonTest, AForwardBackwardFailingMidwayPoisonsTheWindow) {
  ASSERT_TRUE(Train(1).ok());
  // A gradient of the wrong shape makes backward throw after other
  // parameters may already have accumulated theirs.
  Parameter& embedding = model().parameters().front();
  const torch::Tensor kept = embedding.tensor.grad().clone();
  embedding.tensor.mutable_grad() =
      torch::zeros({1}, embedding.tensor.options());
  const absl::Status failed = Train(2);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_TRUE(Poisoned());
  // The failure says it poisoned the window; a second failure of the same
  // window does not claim it again.
  EXPECT_TRUE(PoisonedTheWindow(failed));
  const absl::Status failed_again = Train(3);
  ASSERT_FALSE(failed_again.ok());
  EXPECT_FALSE(PoisonedTheWindow(failed_again));
  // Even with a well-formed gradient back, the window stays untrusted.
  embedding.tensor.mutable_grad() = kept;
  ExpectStepAborted("a ForwardBackward failed");
  ExpectAbortHeals();
}

TEST_F(EnginePoisonTest, ValidationFailuresPoisonNothing) {
  ASSERT_TRUE(Train(1).ok());
  std::vector<Sample> out_of_range = MakeSamples(kVocab, {3}, 5);
  out_of_range[0].input_tokens[0] = kVocab;
  EXPECT_EQ(engine_->ForwardBackward("m", {out_of_range}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Train(2, LossReduction::kSampleMean).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(Poisoned());
  const absl::StatusOr<OptimStepResult> stepped = engine_->OptimStep("m", {});
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(engine_->GetModel("m")->step, 1);
}

TEST_F(EnginePoisonTest, PoisonWindowAbortsTheNextStepWithItsReason) {
  ASSERT_TRUE(Train(1).ok());
  // Only the first poisoning of a window says it poisoned it.
  EXPECT_EQ(engine_->PoisonWindow("m", "seq_id 4 never arrived").value(), true);
  EXPECT_TRUE(Poisoned());
  EXPECT_EQ(engine_->PoisonWindow("m", "another cause").value(), false);
  // A later successful call does not clear it.
  ASSERT_TRUE(Train(2).ok());
  ExpectStepAborted("seq_id 4 never arrived");
  ExpectAbortHeals();
  EXPECT_EQ(engine_->PoisonWindow("nope", "x").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->WindowPoisoned("nope").status().code(),
            absl::StatusCode::kNotFound);
}

// An optimizer step that fails partway (here: one AdamW moment of the wrong
// shape, so that parameter fails after others took their update) leaves the
// model refusing to train or be saved until a LoadCheckpoint; an
// AbortAccumulation does not repair parameters.
TEST_F(EnginePoisonTest, AnOptimStepFailingPartwayDamagesTheModelUntilLoad) {
  std::string dir =
      (std::filesystem::path(::testing::TempDir()) / "damage_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  ASSERT_TRUE(Train(1).ok());
  ASSERT_TRUE(engine_->OptimStep("m", {}).ok());  // the moments exist now
  const std::string saved = dir + "/step1";
  ASSERT_TRUE(engine_->SaveCheckpoint("m", saved).ok());
  const std::vector<torch::Tensor> at_step1 = ParameterValues(model());

  ASSERT_TRUE(Train(2).ok());
  // The last parameter's first moment, misshaped in place (StateTensors
  // alias the live state): the fused update of the others runs first.
  const auto moments =
      EngineTestPeer::OptimizerOf(*engine_, "m").value()->StateTensors();
  ASSERT_FALSE(moments.empty());
  torch::Tensor last_moment = moments[moments.size() - 2].second;
  last_moment.resize_({1});
  const absl::Status failed = engine_->OptimStep("m", {}).status();
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(std::string(failed.message()), HasSubstr("partly updated"));
  const std::vector<torch::Tensor> after = ParameterValues(model());
  bool some_changed = false;
  for (size_t i = 0; i < after.size(); ++i) {
    some_changed |= !torch::equal(after[i], at_step1[i]);
  }
  EXPECT_TRUE(some_changed) << "the failure must be partway for this test";
  EXPECT_THAT(engine_->GetModel("m")->damage, HasSubstr("OptimStep failed"));

  SampleArgs sample;
  sample.prompts = {{1, 2}};
  LogprobsArgs logprobs;
  logprobs.prompts = sample.prompts;
  for (const absl::Status& refused :
       {Train(3), engine_->OptimStep("m", {}).status(),
        engine_->SaveCheckpoint("m", dir + "/damaged").status(),
        engine_->Sample("m", sample).status(),
        engine_->ComputeLogprobs("m", logprobs).status()}) {
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("LoadCheckpoint"));
  }
  ASSERT_TRUE(engine_->AbortAccumulation("m").ok());
  EXPECT_EQ(Train(3).code(), absl::StatusCode::kFailedPrecondition);

  ASSERT_TRUE(
      engine_->LoadCheckpoint("m", saved, /*load_optimizer=*/true).ok());
  EXPECT_EQ(engine_->GetModel("m")->damage, "");
  const std::vector<torch::Tensor> reloaded = ParameterValues(model());
  for (size_t i = 0; i < reloaded.size(); ++i) {
    EXPECT_TRUE(torch::equal(reloaded[i], at_step1[i])) << "parameter " << i;
  }
  ASSERT_TRUE(Train(3).ok());
  ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
  EXPECT_EQ(engine_->GetModel("m")->step, 2);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tally
