// Activation checkpointing (ModelSpec::activation_checkpointing,
// recompute.h): a model that recomputes its layers in backward computes
// bitwise what the same model keeping its activations computes — losses,
// log-probabilities, gradients and the stepped parameters — and its autograd
// graph really holds one recompute node per layer instead of the layers'
// activations. The multi-rank form is FamilyGoldenTest's "/recompute"
// variant (multirank_golden_test.cc).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"
#include "runtime/model/attention_layout.h"
#include "runtime/model/recompute.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::AllEqual;
using ::testing::HasSubstr;
using testing::MakeSamples;
using testing::TinySpec;

// The names of every node reachable from `output`'s grad_fn.
std::multiset<std::string> GraphNodeNames(const torch::Tensor& output) {
  std::multiset<std::string> names;
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack = {output.grad_fn().get()};
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    names.insert(node->name());
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      stack.push_back(edge.function.get());
    }
  }
  return names;
}

size_t CountContaining(const std::multiset<std::string>& names,
                       const std::string& part) {
  size_t n = 0;
  for (const std::string& name : names)
    n += name.find(part) != std::string::npos;
  return n;
}

TEST(RecomputeTest, RunsTheBlockAgainInBackwardOnly) {
  int runs = 0;
  const torch::Tensor w =
      torch::randn({4, 4}, torch::kFloat64).requires_grad_();
  const torch::Tensor x =
      torch::randn({3, 4}, torch::kFloat64).requires_grad_();
  TensorBlock block = [&runs, w](const torch::Tensor& h) {
    ++runs;
    return torch::tanh(torch::mm(h, w));
  };
  torch::Tensor y = RecomputeInBackward(block, x);
  EXPECT_EQ(runs, 1);
  EXPECT_TRUE(torch::equal(y, block(x).detach()));
  runs = 0;
  y = RecomputeInBackward(block, x);
  y.sum().backward();
  EXPECT_EQ(runs, 2) << "forward, then again in backward";
  const torch::Tensor x_grad = x.grad().clone(), w_grad = w.grad().clone();
  x.mutable_grad() = torch::Tensor();
  w.mutable_grad() = torch::Tensor();
  block(x).sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), x_grad));
  EXPECT_TRUE(torch::equal(w.grad(), w_grad));

  torch::NoGradGuard no_grad;  // forward only: runs once, keeps nothing
  runs = 0;
  EXPECT_FALSE(RecomputeInBackward(block, x).requires_grad());
  EXPECT_EQ(runs, 1);
}

TEST(RecomputeTest, ParametersTakeGradientsBehindAnInputOutsideTheGraph) {
  // A frozen embedding's output does not require grad; the layer's weights
  // must still get theirs.
  const torch::Tensor w =
      torch::randn({4, 4}, torch::kFloat64).requires_grad_();
  const torch::Tensor x = torch::randn({3, 4}, torch::kFloat64);
  RecomputeInBackward([w](const torch::Tensor& h) { return torch::mm(h, w); },
                      x)
      .sum()
      .backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_TRUE(torch::allclose(w.grad(), x.sum(0).unsqueeze(1).expand({4, 4})));
}

class ActivationCheckpointingTest
    : public ::testing::TestWithParam<std::tuple<DType, const char*>> {};

TEST_P(ActivationCheckpointingTest, BitwiseEqualToKeepingActivations) {
  const auto [dtype, family] = GetParam();
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec kept = TinySpec("kept", dtype, OptimizerKind::kAdamW);
  kept.config.model_type = family;
  if (std::string(family) == "qwen3") kept.config.head_dim = 12;
  if (std::string(family) == "mistral") kept.config.sliding_window = 5;
  ModelSpec recomputed = kept;
  recomputed.model_id = "recomputed";
  recomputed.activation_checkpointing = true;
  ASSERT_TRUE(engine->CreateModel(kept).ok());
  auto created = engine->CreateModel(recomputed);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(created->activation_checkpointing);
  EXPECT_TRUE(
      EngineTestPeer::Model(*engine, "recomputed").value()->recompute_layers());
  EXPECT_FALSE(
      EngineTestPeer::Model(*engine, "kept").value()->recompute_layers());

  const int64_t vocab = kept.config.vocab_size;
  OptimStepArgs step;
  step.max_grad_norm = 0.05;  // clipping active
  for (int window = 0; window < 2; ++window) {
    for (const uint64_t seed : {11u, 12u}) {
      ForwardBackwardArgs args{MakeSamples(vocab, {7, 2, 19}, seed + window)};
      args.return_logprobs = true;
      auto a = engine->ForwardBackward("kept", args);
      auto b = engine->ForwardBackward("recomputed", args);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
      EXPECT_EQ(a->loss_sum, b->loss_sum);
      for (size_t i = 0; i < a->samples.size(); ++i) {
        EXPECT_EQ(a->samples[i].logprobs, b->samples[i].logprobs);
      }
    }
    EXPECT_TRUE(AllEqual(
        testing::Gradients(*EngineTestPeer::Model(*engine, "kept").value()),
        testing::Gradients(
            *EngineTestPeer::Model(*engine, "recomputed").value())));
    auto a = engine->OptimStep("kept", step);
    auto b = engine->OptimStep("recomputed", step);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    EXPECT_EQ(a->grad_norm, b->grad_norm);
    EXPECT_LT(a->clip_coef, 1.0);
    EXPECT_TRUE(
        AllEqual(testing::ParameterValues(
                     *EngineTestPeer::Model(*engine, "kept").value()),
                 testing::ParameterValues(
                     *EngineTestPeer::Model(*engine, "recomputed").value())));
  }
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndFamilies, ActivationCheckpointingTest,
    ::testing::Combine(::testing::Values(DType::kFloat64, DType::kFloat32),
                       ::testing::Values("llama", "qwen3", "mistral")),
    [](const auto& info) {
      return absl::StrCat(
          std::get<0>(info.param) == DType::kFloat64 ? "f64_" : "f32_",
          std::get<1>(info.param));
    });

TEST(ActivationCheckpointingGraphTest, OneRecomputeNodePerLayer) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec = TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW);
  spec.config.num_hidden_layers = 3;
  ASSERT_TRUE(engine->CreateModel(spec).ok());
  CausalLm& model = *EngineTestPeer::Model(*engine, "m").value();
  const torch::Tensor ids =
      torch::randint(0, spec.config.vocab_size, {2, 6}, torch::kInt64);
  const AttentionLayout layout = AttentionLayout::RightPadded({6, 4}, 6);
  for (const bool recompute : {false, true}) {
    ASSERT_TRUE(model.set_recompute_layers(recompute).ok());
    const std::multiset<std::string> names =
        GraphNodeNames(model.TargetLogprobs(ids, ids, layout));
    EXPECT_EQ(CountContaining(names, "Recompute"), recompute ? 3u : 0u);
    // The layers' matmuls (7 a layer) are inside the recompute nodes, not in
    // the graph; the LM head is one chunked node (kernels/chunked_xent.h).
    const size_t matmuls = CountContaining(names, "MmBackward") +
                           CountContaining(names, "AddmmBackward");
    EXPECT_EQ(matmuls, recompute ? 0u : 3u * 7u);
    EXPECT_EQ(CountContaining(names, "ChunkedTargetLogprobs"), 1u);
  }
}

TEST(ActivationCheckpointingGraphTest, MixtureOfExpertsRefusesIt) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec = TinySpec("moe", DType::kFloat64, OptimizerKind::kAdamW);
  spec.config.model_type = "mixtral";
  spec.config.num_local_experts = 4;
  spec.config.num_experts_per_tok = 2;
  spec.activation_checkpointing = true;
  const auto created = engine->CreateModel(spec);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(created.status().message(),
              HasSubstr("activation_checkpointing"));
  EXPECT_FALSE(EngineTestPeer::Model(*engine, "moe").ok())
      << "a refused model is not created";
}

}  // namespace
}  // namespace tally
