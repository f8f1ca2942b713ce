// What an OptimStep writes: never a non-finite value. A step whose gradients
// could overflow what it writes (1e30-scale gradients, clipping off: AdamW's
// second moment squares them past float32, SGD's update multiplies them by
// the learning rate) is refused under nonfinite ERROR and skipped under
// SKIP, parameters and optimizer state unchanged, although the norm itself
// is finite. An update the norm's bound cannot foresee (an absurd learning
// rate) is found by the sweep after it: the model is marked damaged instead
// of training on infinities.
#include "runtime/train/step_guard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::AllEqual;
using ::testing::HasSubstr;
using testing::MakeSamples;
using testing::ParameterValues;
using testing::TinySpec;

constexpr int64_t kVocab = 48;

bool AllFinite(const std::vector<torch::Tensor>& tensors) {
  for (const torch::Tensor& t : tensors) {
    if (!torch::isfinite(t).all().item<bool>()) return false;
  }
  return true;
}

class StepGuardTest : public ::testing::TestWithParam<OptimizerKind> {
 protected:
  void SetUp() override {
    engine_ = Engine::CreateSingleRank({}).value();
    ASSERT_TRUE(
        engine_->CreateModel(TinySpec("m", DType::kFloat32, GetParam())).ok());
    // One ordinary step first, so that AdamW's moments are not zero.
    ASSERT_TRUE(Train(1.0f).ok());
    ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
    // Then a window whose gradient is ~1e30: finite in float32, its square
    // not.
    ASSERT_TRUE(Train(1e30f).ok());
    before_ = State();
    ASSERT_TRUE(AllFinite(before_));
  }

  absl::Status Train(float weight) {
    ForwardBackwardArgs args{MakeSamples(kVocab, {6, 3}, 2)};
    args.reduction = LossReduction::kSum;
    for (Sample& s : args.samples) {
      s.weights.assign(s.input_tokens.size(), weight);
    }
    return engine_->ForwardBackward("m", args).status();
  }

  // Copies of the parameters, then of the optimizer state.
  std::vector<torch::Tensor> State() {
    std::vector<torch::Tensor> out =
        ParameterValues(*EngineTestPeer::Model(*engine_, "m").value());
    for (const auto& [name, t] :
         EngineTestPeer::OptimizerOf(*engine_, "m").value()->StateTensors()) {
      out.push_back(t.clone());
    }
    return out;
  }

  OptimStepArgs Args(NonFinitePolicy policy) const {
    OptimStepArgs args;
    args.max_grad_norm = 0.0;  // no clipping
    args.nonfinite = policy;
    // SGD's update overflows at this gradient once the rate is this large.
    if (GetParam() == OptimizerKind::kSgd) args.adam.learning_rate = 1e10;
    return args;
  }

  std::unique_ptr<Engine> engine_;
  std::vector<torch::Tensor> before_;
};

TEST_P(StepGuardTest, ErrorRefusesAndChangesNothing) {
  const absl::StatusOr<OptimStepResult> result =
      engine_->OptimStep("m", Args(NonFinitePolicy::kError));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr("nothing changed and the window is kept"));
  EXPECT_TRUE(AllEqual(before_, State()));
  const ModelSummary model = engine_->GetModel("m").value();
  EXPECT_EQ(model.window.calls, 1);
  EXPECT_EQ(model.step, 1);
  EXPECT_EQ(model.damage, "");
}

TEST_P(StepGuardTest, SkipSkipsAndChangesNothing) {
  const absl::StatusOr<OptimStepResult> result =
      engine_->OptimStep("m", Args(NonFinitePolicy::kSkip));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->skipped);
  EXPECT_TRUE(std::isfinite(result->grad_norm));
  EXPECT_GT(result->grad_norm, 1e20);
  EXPECT_THAT(result->skip_reason, HasSubstr("gradient norm"));
  EXPECT_EQ(result->step, 1);
  EXPECT_TRUE(AllEqual(before_, State()));
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 0);
  // Training goes on from where it was.
  ASSERT_TRUE(Train(1.0f).ok());
  const absl::StatusOr<OptimStepResult> next = engine_->OptimStep("m", {});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(next->skipped);
  EXPECT_EQ(next->step, 2);
  EXPECT_TRUE(AllFinite(State()));
}

INSTANTIATE_TEST_SUITE_P(Optimizers, StepGuardTest,
                         ::testing::Values(OptimizerKind::kAdamW,
                                           OptimizerKind::kSgd),
                         [](const auto& info) {
                           return std::string(OptimizerName(info.param));
                         });

// The bound is the clipped norm, against the master dtype: clipping brings a
// huge norm back, float64 holds what float32 cannot, and a bfloat16 model's
// float32 masters decide for it.
TEST(UnsafeStepReasonTest, TheBoundIsTheClippedNormInTheMasterDtype) {
  const AdamParams hp;
  ClipResult clip;
  clip.norm.total = 1e30;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    EXPECT_NE(UnsafeStepReason(clip, hp, OptimizerKind::kAdamW, dtype),
              std::nullopt);
  }
  EXPECT_EQ(UnsafeStepReason(clip, hp, OptimizerKind::kAdamW, DType::kFloat64),
            std::nullopt);
  // 1e-2 x 1e30 is a finite float32 update.
  EXPECT_EQ(UnsafeStepReason(clip, hp, OptimizerKind::kSgd, DType::kFloat32),
            std::nullopt);
  clip.clip_coef = 1e-30;
  EXPECT_EQ(UnsafeStepReason(clip, hp, OptimizerKind::kAdamW, DType::kFloat32),
            std::nullopt);
  clip.norm.total = std::numeric_limits<double>::infinity();
  EXPECT_THAT(UnsafeStepReason(clip, hp, OptimizerKind::kAdamW, DType::kFloat64)
                  .value_or(""),
              HasSubstr("non-finite gradient norm"));
}

// An update no gradient bound foresees (a learning rate near float32's
// largest value) is found after it: the step fails and the model refuses to
// train on until a LoadCheckpoint, instead of going on with infinities.
TEST(StepGuardSweepTest, AnUpdateThatOverflowsAnywayLeavesTheModelDamaged) {
  auto engine = Engine::CreateSingleRank({}).value();
  ASSERT_TRUE(
      engine->CreateModel(TinySpec("m", DType::kFloat32, OptimizerKind::kAdamW))
          .ok());
  ASSERT_TRUE(
      engine->ForwardBackward("m", {MakeSamples(kVocab, {6, 3}, 2)}).ok());
  OptimStepArgs args;
  args.adam.learning_rate = 1e38;
  const absl::StatusOr<OptimStepResult> result = engine->OptimStep("m", args);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr("the update left non-finite values in "));
  EXPECT_NE(engine->GetModel("m")->damage, "");
  EXPECT_EQ(engine->ForwardBackward("m", {MakeSamples(kVocab, {6, 3}, 3)})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tally
