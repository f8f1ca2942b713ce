// Mixture of experts on one rank: the config (validation, Mixtral
// config.json), HF's per-expert checkpoint names, and the MoE layer against a
// per-token computation written out here.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "runtime/checkpoint/checkpoint.h"
#include "runtime/config/llama_config.h"
#include "runtime/engine/engine.h"
#include "runtime/model/llama_model.h"
#include "runtime/model/moe_block.h"
#include "runtime/train/optimizer.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

LlamaConfig Moe(int64_t experts = 4, int64_t per_token = 2) {
  LlamaConfig c = testing::TinyConfig();
  c.num_local_experts = experts;
  c.num_experts_per_tok = per_token;
  return c;
}

TEST(MoeConfigTest, ValidatesTheExpertFields) {
  EXPECT_TRUE(Moe().Validate().ok());
  EXPECT_THAT(std::string(Moe(4, 5).Validate().message()),
              HasSubstr("config.num_experts_per_tok"));
  EXPECT_THAT(std::string(Moe(-1, 0).Validate().message()),
              HasSubstr("config.num_local_experts"));
  LlamaConfig c = Moe();
  c.router_aux_loss_coef = -1;
  EXPECT_THAT(std::string(c.Validate().message()),
              HasSubstr("config.router_aux_loss_coef"));
  LlamaConfig dense = testing::TinyConfig();
  dense.num_experts_per_tok = 2;
  EXPECT_FALSE(dense.Validate().ok());
  LlamaConfig defaults = Moe(8, 0).WithDefaults();
  EXPECT_EQ(defaults.num_experts_per_tok, 2);  // HF's default
  EXPECT_TRUE(ValidateExpertParallel(Moe(), 2).ok());
  EXPECT_THAT(std::string(ValidateExpertParallel(Moe(), 3).message()),
              HasSubstr("not divisible by ep"));
  EXPECT_TRUE(ValidateExpertParallel(testing::TinyConfig(), 2).ok());
}

TEST(MoeConfigTest, MixtralJsonRoundTrips) {
  LlamaConfig c = Moe();
  c.router_aux_loss_coef = 0.02;
  c.output_router_logits = true;
  const std::string json = c.ToHfJson("float32");
  nlohmann::json j = nlohmann::json::parse(json);
  EXPECT_EQ(j["model_type"], "mixtral");
  EXPECT_EQ(j["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(j["num_local_experts"], 4);
  EXPECT_EQ(j["output_router_logits"], true);
  absl::StatusOr<LlamaConfig> read = LlamaConfig::FromHfJson(json);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, c.WithDefaults());
  // HF's MixtralConfig defaults, and no aux loss without router logits.
  j.erase("num_local_experts");
  j.erase("num_experts_per_tok");
  j["output_router_logits"] = false;
  read = LlamaConfig::FromHfJson(j.dump());
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->num_local_experts, 8);
  EXPECT_EQ(read->num_experts_per_tok, 2);
  EXPECT_EQ(read->router_aux_loss_coef, 0.02);
  EXPECT_EQ(read->load_balancing_coefficient(), 0.0);
  // A dense config stays a llama one.
  nlohmann::json dense =
      nlohmann::json::parse(testing::TinyConfig().ToHfJson("float32"));
  EXPECT_EQ(dense["model_type"], "llama");
  EXPECT_FALSE(dense.contains("num_local_experts"));
}

TEST(MoeCheckpointNamesTest, StacksAndSplitsPerExpertWeights) {
  const std::string stacked =
      "model.layers.1.block_sparse_moe.experts.w2.weight";
  EXPECT_EQ(StackedExpertName("model.layers.1.block_sparse_moe.experts.3.w2."
                              "weight"),
            std::make_pair(stacked, int64_t{3}));
  EXPECT_FALSE(StackedExpertName("model.layers.1.block_sparse_moe.gate.weight")
                   .has_value());
  torch::Tensor w = torch::randn({3, 2, 5});
  NamedTensors hf = ExpertWeightsToHf(
      {{"a", torch::ones({1})}, {stacked, w}, {"b", torch::zeros({1})}});
  ASSERT_EQ(hf.size(), 5u);
  EXPECT_EQ(hf[0].first, "a");
  EXPECT_EQ(hf[2].first, "model.layers.1.block_sparse_moe.experts.1.w2.weight");
  EXPECT_TRUE(torch::equal(hf[2].second, w[1]));
  // Any order of the experts stacks back.
  std::swap(hf[1], hf[3]);
  absl::StatusOr<NamedTensors> back = ExpertWeightsFromHf(hf);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 3u);
  EXPECT_EQ((*back)[1].first, stacked);
  EXPECT_TRUE(torch::equal((*back)[1].second, w));
  hf.erase(hf.begin() + 2);  // expert 1
  EXPECT_THAT(std::string(ExpertWeightsFromHf(hf).status().message()),
              HasSubstr("miss expert 1"));
}

TEST(MoeCheckpointNamesTest, CheckpointHoldsHfMixtralNames) {
  auto model = LlamaModel::Create(Moe(), DType::kFloat64, 3).value();
  Optimizer optimizer(OptimizerKind::kAdamW, &model->parameters());
  const std::string dir = ::testing::TempDir() + "tally_moe_names";
  ASSERT_TRUE(WriteCheckpoint(dir, *model, optimizer, {}).ok());
  NamedTensors written = ReadSafetensors(dir + "/model.safetensors").value();
  std::set<std::string> names;
  for (const auto& [name, t] : written) names.insert(name);
  EXPECT_TRUE(names.count("model.layers.0.block_sparse_moe.gate.weight"));
  EXPECT_TRUE(
      names.count("model.layers.1.block_sparse_moe.experts.3.w3.weight"));
  EXPECT_FALSE(names.count("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_EQ(names.size(), 2 + 1 + 2 * (2 + 4 + 1 + 4 * 3));

  auto other = LlamaModel::Create(Moe(), DType::kFloat64, 4).value();
  CheckpointContents contents = ReadCheckpoint(dir, false).value();
  ASSERT_TRUE(LoadWeightsInto(contents, *other).ok());
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(model->parameters()[i].tensor,
                             other->parameters()[i].tensor))
        << model->parameters()[i].name;
  }
  std::filesystem::remove_all(dir);
}

// With top-k = E every token uses every expert with its softmax probability
// p_e: for a one-token input (whose p_e are computed here by hand) the MoE
// layer equals a dense SwiGLU whose rows are the experts' concatenated and
// whose down projection of expert e is scaled by p_e.
TEST(MoeModelTest, TopKOfAllExpertsIsTheSoftmaxMixture) {
  LlamaConfig config = Moe(3, 3);
  config.num_hidden_layers = 1;
  auto moe = LlamaModel::Create(config, DType::kFloat64, 11).value();
  torch::Tensor inputs = torch::tensor({{7}}, torch::kInt64);
  torch::Tensor targets = torch::tensor({{5}}, torch::kInt64);
  const AttentionLayout layout = AttentionLayout::RightPadded({1}, 1);
  const double got =
      moe->TargetLogprobs(inputs, targets, layout).item<double>();

  LlamaConfig dense_config = config;
  dense_config.num_local_experts = 0;
  dense_config.num_experts_per_tok = 0;
  dense_config.intermediate_size = 3 * config.intermediate_size;
  auto dense = LlamaModel::Create(dense_config, DType::kFloat64, 11).value();
  torch::NoGradGuard no_grad;
  // The shared weights, then the MLP from the experts.
  auto copy = [&](const std::string& name) {
    dense->Find(name)->tensor.copy_(moe->Find(name)->tensor);
  };
  for (const char* name :
       {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight"}) {
    copy(name);
  }
  // The one token's router probabilities, from its post-attention input.
  torch::Tensor x = moe->Find("model.embed_tokens.weight")->tensor[7];
  // One token attends to itself only: attention output = o(v(norm(x))).
  auto norm = [&](const torch::Tensor& t, const std::string& w) {
    return moe->Find(w)->tensor *
           (t * torch::rsqrt(t.pow(2).mean() + config.rms_norm_eps));
  };
  torch::Tensor v =
      torch::mv(moe->Find("model.layers.0.self_attn.v_proj.weight")->tensor,
                norm(x, "model.layers.0.input_layernorm.weight"));
  // GQA: query head j reads kv head j / 2; with one key, softmax is 1.
  const int64_t d = config.HeadDim();
  torch::Tensor heads =
      v.view({config.num_key_value_heads, d})
          .repeat_interleave(
              config.num_attention_heads / config.num_key_value_heads, 0)
          .flatten();
  x = x + torch::mv(moe->Find("model.layers.0.self_attn.o_proj.weight")->tensor,
                    heads);
  torch::Tensor h = norm(x, "model.layers.0.post_attention_layernorm.weight");
  torch::Tensor p = torch::softmax(
      torch::mv(
          moe->Find("model.layers.0.block_sparse_moe.gate.weight")->tensor, h),
      0);
  const auto& w1 =
      moe->Find("model.layers.0.block_sparse_moe.experts.w1.weight")->tensor;
  const auto& w2 =
      moe->Find("model.layers.0.block_sparse_moe.experts.w2.weight")->tensor;
  const auto& w3 =
      moe->Find("model.layers.0.block_sparse_moe.experts.w3.weight")->tensor;
  dense->Find("model.layers.0.mlp.gate_proj.weight")
      ->tensor.copy_(w1.flatten(0, 1));
  dense->Find("model.layers.0.mlp.up_proj.weight")
      ->tensor.copy_(w3.flatten(0, 1));
  dense->Find("model.layers.0.mlp.down_proj.weight")
      ->tensor.copy_((w2 * p.view({-1, 1, 1})).permute({1, 0, 2}).flatten(1));
  const double want =
      dense->TargetLogprobs(inputs, targets, layout).item<double>();
  EXPECT_LT(std::abs(got - want), 1e-12 * std::abs(want));
}

// HF's load-balancing loss, per sample, joins each token's loss like the
// cross-entropy: the window's gradient is the same whether its samples come
// in one call or one call each, in one micro-batch or several.
TEST(MoeAuxLossTest, GradientDoesNotDependOnTheSplit) {
  for (LossReduction reduction :
       {LossReduction::kTokenMean, LossReduction::kSampleMean}) {
    SCOPED_TRACE(ReductionName(reduction));
    ModelSpec spec =
        testing::TinySpec("m", DType::kFloat64, OptimizerKind::kSgd);
    spec.config = Moe();
    spec.config.router_aux_loss_coef = 0.5;
    spec.config.output_router_logits = true;
    const std::vector<Sample> samples =
        testing::MakeSamples(spec.config.vocab_size, {9, 4, 13, 1}, 31);
    auto whole = Engine::CreateSingleRank({}).value();
    EngineOptions small;
    small.max_batch_tokens = 8;
    auto split = Engine::CreateSingleRank(small).value();
    ASSERT_TRUE(whole->CreateModel(spec).ok());
    ASSERT_TRUE(split->CreateModel(spec).ok());
    ASSERT_TRUE(whole->ForwardBackward("m", {samples, reduction}).ok());
    for (const Sample& sample : samples) {
      ASSERT_TRUE(split->ForwardBackward("m", {{sample}, reduction}).ok());
    }
    const std::vector<torch::Tensor> want =
        testing::Gradients(*EngineTestPeer::Model(*whole, "m").value());
    const std::vector<torch::Tensor> got =
        testing::Gradients(*EngineTestPeer::Model(*split, "m").value());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_LT(testing::RelativeDiff(got[i], want[i]), 1e-12) << i;
    }
    // And the term is there: without it the router's gradient differs.
    spec.config.router_aux_loss_coef = 0;
    auto plain = Engine::CreateSingleRank({}).value();
    ASSERT_TRUE(plain->CreateModel(spec).ok());
    ASSERT_TRUE(plain->ForwardBackward("m", {samples, reduction}).ok());
    const Parameter* router =
        EngineTestPeer::Model(*plain, "m")
            .value()
            ->Find("model.layers.0.block_sparse_moe.gate.weight");
    const Parameter* with_aux =
        EngineTestPeer::Model(*whole, "m")
            .value()
            ->Find("model.layers.0.block_sparse_moe.gate.weight");
    EXPECT_GT(
        testing::RelativeDiff(with_aux->tensor.grad(), router->tensor.grad()),
        1e-3);
  }
}

}  // namespace
}  // namespace tally
