// The core guarantee: an accumulation window of uneven ForwardBackward calls
// produces the gradients, norm and update of one single-device step on all of
// its samples, and both equal an independent reference built directly from
// the model's log-probabilities.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "runtime/engine/engine.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::GoldenTolerance;
using testing::Gradients;
using testing::MakeSamples;
using testing::ParameterValues;
using testing::RelativeDiff;
using testing::TinySpec;

struct Case {
  DType dtype;
  OptimizerKind optimizer;
  LossReduction reduction;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::string(DTypeName(info.param.dtype)) + "_" +
         OptimizerName(info.param.optimizer) + "_" +
         ReductionName(info.param.reduction);
}

// The reference loss of the whole window, written from the definitions in
// docs/architecture.md: one sample at a time (no padding, no batching).
torch::Tensor ReferenceLoss(CausalLm& model, const std::vector<Sample>& all,
                            LossReduction reduction) {
  const auto dtype = model.scalar_type();
  torch::Tensor total = torch::zeros({}, dtype);
  int64_t tokens = 0, samples = 0;
  for (const Sample& s : all) {
    const int64_t n = static_cast<int64_t>(s.input_tokens.size());
    std::vector<int64_t> in(s.input_tokens.begin(), s.input_tokens.end());
    std::vector<int64_t> target(n);
    std::vector<double> weight(n);
    int64_t valid = 0;
    for (int64_t t = 0; t < n; ++t) {
      const bool ok = s.target_tokens[t] != kIgnoreIndex && s.weights[t] > 0;
      target[t] = ok ? s.target_tokens[t] : 0;
      weight[t] = ok ? s.weights[t] : 0.0;
      valid += ok;
    }
    torch::Tensor logprobs = model.TargetLogprobs(
        torch::tensor(in).view({1, n}), torch::tensor(target).view({1, n}),
        AttentionLayout::RightPadded({n}, n));
    torch::Tensor w = torch::tensor(weight).to(dtype).view({1, n});
    torch::Tensor sample_sum = -(logprobs * w).sum();
    tokens += valid;
    if (reduction == LossReduction::kSampleMean) {
      if (valid == 0) continue;
      total = total + sample_sum / static_cast<double>(valid);
      ++samples;
    } else {
      total = total + sample_sum;
    }
  }
  switch (reduction) {
    case LossReduction::kTokenMean:
      return total / static_cast<double>(tokens);
    case LossReduction::kSampleMean:
      return total / static_cast<double>(samples);
    case LossReduction::kSum:
      return total;
  }
  return total;
}

class WindowEquivalenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(WindowEquivalenceTest, UnevenCallsEqualOneCallAndTheReference) {
  const Case c = GetParam();
  const double tol = GoldenTolerance(c.dtype);
  auto engine = Engine::CreateSingleRank({}).value();
  const int64_t vocab = testing::TinyConfig().vocab_size;
  // 1, 7, 50 and 300 valid tokens; call 2 holds a sample with none.
  const std::vector<std::vector<Sample>> calls = {
      MakeSamples(vocab, {1}, 11), MakeSamples(vocab, {3, 0, 4}, 12),
      MakeSamples(vocab, {20, 30}, 13), MakeSamples(vocab, {100, 150, 50}, 14)};
  std::vector<Sample> all;
  for (const auto& call : calls)
    all.insert(all.end(), call.begin(), call.end());

  ModelSpec spec = TinySpec("split", c.dtype, c.optimizer);
  // FLOAT32 AdamW runs with the default eps; its parameters are within
  // kFp32AdamParamTolerance (see there), its gradients and norm within 1e-5.
  const bool fp32_adamw =
      c.dtype == DType::kFloat32 && c.optimizer == OptimizerKind::kAdamW;
  const double param_tol = fp32_adamw ? testing::kFp32AdamParamTolerance : tol;
  for (const char* id : {"split", "whole", "ref"}) {
    spec.model_id = id;
    ASSERT_TRUE(engine->CreateModel(spec).ok());
  }
  for (const auto& call : calls) {
    ForwardBackwardArgs args{call, c.reduction};
    ASSERT_TRUE(engine->ForwardBackward("split", args).ok());
  }
  auto whole = engine->ForwardBackward("whole", {all, c.reduction});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->window.tokens, 1 + 7 + 50 + 300);
  EXPECT_EQ(engine->GetModel("split")->window.tokens, 358);
  EXPECT_EQ(engine->GetModel("split")->window.calls, 4);
  EXPECT_EQ(engine->GetModel("split")->window.samples,
            engine->GetModel("whole")->window.samples);

  CausalLm& split_model = *EngineTestPeer::Model(*engine, "split").value();
  CausalLm& whole_model = *EngineTestPeer::Model(*engine, "whole").value();
  CausalLm& ref_model = *EngineTestPeer::Model(*engine, "ref").value();
  const std::vector<torch::Tensor> before = ParameterValues(split_model);
  const auto split_grads = Gradients(split_model);
  const auto whole_grads = Gradients(whole_model);

  // Independent reference gradient of the normalized window loss.
  ReferenceLoss(ref_model, all, c.reduction).backward();
  const auto ref_grads = Gradients(ref_model);
  const double normalizer =
      c.reduction == LossReduction::kTokenMean ? 358.0
      : c.reduction == LossReduction::kSampleMean
          ? static_cast<double>(engine->GetModel("split")->window.samples)
          : 1.0;
  double sq = 0;
  for (size_t i = 0; i < split_grads.size(); ++i) {
    EXPECT_LT(RelativeDiff(split_grads[i], whole_grads[i]), tol) << i;
    EXPECT_LT(RelativeDiff(split_grads[i] / normalizer, ref_grads[i]), tol)
        << split_model.parameters()[i].name;
    sq += ref_grads[i].to(torch::kFloat64).pow(2).sum().item<double>();
  }
  const double ref_norm = std::sqrt(sq);

  OptimStepArgs step;
  step.max_grad_norm = ref_norm / 2;  // clipping must be active
  auto split_step = engine->OptimStep("split", step);
  auto whole_step = engine->OptimStep("whole", step);
  ASSERT_TRUE(split_step.ok()) << split_step.status();
  ASSERT_TRUE(whole_step.ok()) << whole_step.status();
  EXPECT_LT(RelativeDiff(split_step->grad_norm, ref_norm), tol);
  EXPECT_LT(RelativeDiff(whole_step->grad_norm, ref_norm), tol);
  EXPECT_EQ(split_step->normalizer, normalizer);
  const double clip = (ref_norm / 2) / (ref_norm + 1e-6);
  EXPECT_LT(RelativeDiff(split_step->clip_coef, clip), tol);
  EXPECT_LT(split_step->clip_coef, 0.51);

  // Independent first update: SGD or AdamW written out from the formulas.
  const AdamParams hp = spec.default_adam;
  const auto after_split = ParameterValues(split_model);
  const auto after_whole = ParameterValues(whole_model);
  for (size_t i = 0; i < before.size(); ++i) {
    torch::Tensor g = ref_grads[i] * clip;
    torch::Tensor p = before[i] * (1 - hp.learning_rate * hp.weight_decay);
    if (c.optimizer == OptimizerKind::kSgd) {
      p = p - hp.learning_rate * g;
    } else {
      torch::Tensor m = (1 - hp.beta1) * g;
      torch::Tensor v = (1 - hp.beta2) * g * g;
      torch::Tensor denom = v.sqrt() / std::sqrt(1 - hp.beta2) + hp.eps;
      p = p - (hp.learning_rate / (1 - hp.beta1)) * m / denom;
    }
    EXPECT_LT(RelativeDiff(after_split[i], after_whole[i]), param_tol) << i;
    EXPECT_LT(RelativeDiff(after_split[i], p), param_tol)
        << split_model.parameters()[i].name;
    EXPECT_GT(RelativeDiff(after_split[i], before[i]), 1e-4) << "no update";
  }
  EXPECT_EQ(engine->GetModel("split")->step, 1);
  EXPECT_EQ(engine->GetModel("split")->window.calls, 0);
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (DType d : {DType::kFloat64, DType::kFloat32}) {
    for (OptimizerKind o : {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
      for (LossReduction r :
           {LossReduction::kTokenMean, LossReduction::kSampleMean,
            LossReduction::kSum}) {
        cases.push_back({d, o, r});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Golden, WindowEquivalenceTest,
                         ::testing::ValuesIn(AllCases()), CaseName);

}  // namespace
}  // namespace tally
