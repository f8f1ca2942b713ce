// The model families at the config level: the real config.json files of the
// models people fine-tune (tests/data/hf_configs, byte-exact copies from the
// HF Hub) parse with the file's values, round-trip through ToHfJson, and
// build a one-layer model (vocabulary kept) that trains a step; fields whose
// math tally does not implement are refused naming the field.
#include "runtime/config/model_family.h"

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/config/families/registry.h"
#include "runtime/config/llama_config.h"
#include "runtime/engine/engine.h"
#include "server/convert.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

std::string ReadConfigFile(const std::string& name) {
  const char* source_dir = std::getenv("TALLY_SOURCE_DIR");
  const std::string root = source_dir != nullptr ? source_dir : ".";
  std::ifstream in(root + "/tests/data/hf_configs/" + name + ".json");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class RealConfigTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    text_ = ReadConfigFile(GetParam());
    ASSERT_FALSE(text_.empty()) << GetParam();
    json_ = nlohmann::json::parse(text_);
  }
  std::string text_;
  nlohmann::json json_;
};

TEST_P(RealConfigTest, ParsesWithTheFileValues) {
  absl::StatusOr<LlamaConfig> parsed = LlamaConfig::FromHfJson(text_);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const LlamaConfig& c = *parsed;
  const nlohmann::json& j = json_;
  EXPECT_EQ(c.model_type, j["model_type"]);
  EXPECT_EQ(c.vocab_size, j["vocab_size"]);
  EXPECT_EQ(c.hidden_size, j["hidden_size"]);
  EXPECT_EQ(c.intermediate_size, j["intermediate_size"]);
  EXPECT_EQ(c.num_hidden_layers, j["num_hidden_layers"]);
  EXPECT_EQ(c.num_attention_heads, j["num_attention_heads"]);
  EXPECT_EQ(c.num_key_value_heads, j["num_key_value_heads"]);
  EXPECT_EQ(c.max_position_embeddings, j["max_position_embeddings"]);
  EXPECT_EQ(c.rms_norm_eps, j["rms_norm_eps"].get<double>());
  EXPECT_EQ(c.rope_theta, j["rope_theta"].get<double>());
  EXPECT_EQ(c.tie_word_embeddings, j.value("tie_word_embeddings", false));
  EXPECT_EQ(c.HeadDim(), j.contains("head_dim")
                             ? j["head_dim"].get<int64_t>()
                             : c.hidden_size / c.num_attention_heads);
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const nlohmann::json& r = j["rope_scaling"];
    EXPECT_EQ(c.rope_scaling.rope_type, r["rope_type"]);
    EXPECT_EQ(c.rope_scaling.factor, r["factor"].get<double>());
    EXPECT_EQ(c.rope_scaling.low_freq_factor,
              r["low_freq_factor"].get<double>());
    EXPECT_EQ(c.rope_scaling.high_freq_factor,
              r["high_freq_factor"].get<double>());
    EXPECT_EQ(c.rope_scaling.original_max_position_embeddings,
              r["original_max_position_embeddings"]);
  } else {
    EXPECT_EQ(c.rope_scaling.rope_type, "");
  }
  // A window only where the file turns one on (Qwen: use_sliding_window;
  // Mistral, Mixtral: a non-null sliding_window).
  const bool window_on =
      j.contains("use_sliding_window")
          ? j["use_sliding_window"].get<bool>()
          : j.contains("sliding_window") && !j["sliding_window"].is_null();
  EXPECT_EQ(c.sliding_window,
            window_on ? j["sliding_window"].get<int64_t>() : 0);
  if (c.model_type == "mixtral") {
    EXPECT_EQ(c.num_local_experts, j["num_local_experts"]);
    EXPECT_EQ(c.num_experts_per_tok, j["num_experts_per_tok"]);
    EXPECT_EQ(c.router_aux_loss_coef, j["router_aux_loss_coef"].get<double>());
    EXPECT_EQ(c.output_router_logits, j.value("output_router_logits", false));
  }
}

TEST_P(RealConfigTest, RoundTripsThroughTheFamilysConfigJson) {
  absl::StatusOr<LlamaConfig> parsed = LlamaConfig::FromHfJson(text_);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const std::string written = parsed->ToHfJson("bfloat16");
  const nlohmann::json out = nlohmann::json::parse(written);
  EXPECT_EQ(out["architectures"], json_["architectures"]);
  EXPECT_EQ(out["model_type"], json_["model_type"]);
  absl::StatusOr<LlamaConfig> reread = LlamaConfig::FromHfJson(written);
  ASSERT_TRUE(reread.ok()) << reread.status();
  EXPECT_TRUE(*reread == *parsed) << written;
}

// One layer, every size and the vocabulary as in the file. Past ~200M
// parameters the embeddings (and a MoE's experts) are frozen so the step's
// gradients and AdamW state fit the CI machine next to a parallel test.
TEST_P(RealConfigTest, OneLayerModelTrainsAStep) {
  absl::StatusOr<LlamaConfig> parsed = LlamaConfig::FromHfJson(text_);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ModelSpec spec;
  spec.model_id = "real";
  spec.seed = 3;
  spec.config = *parsed;
  spec.config.num_hidden_layers = 1;
  const bool frozen_embeddings = spec.config.NumParameters() > 200'000'000;
  if (frozen_embeddings) {
    spec.frozen = {"model.embed_tokens.weight"};
    if (!spec.config.tie_word_embeddings)
      spec.frozen.push_back("lm_head.weight");
    if (spec.config.is_moe()) {
      for (const char* w : {"w1", "w2", "w3"}) {
        spec.frozen.push_back(absl::StrCat(
            "model.layers.*.block_sparse_moe.experts.", w, ".weight"));
      }
    }
  }
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::CreateSingleRank({});
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE((*engine)->CreateModel(spec).ok());
  CausalLm& model = *EngineTestPeer::Model(**engine, "real").value();
  const torch::Tensor before =
      model.Find("model.layers.0.self_attn.q_proj.weight")->tensor.clone();
  absl::StatusOr<ForwardBackwardResult> forward = (*engine)->ForwardBackward(
      "real", {testing::MakeSamples(spec.config.vocab_size, {6, 3}, 5)});
  ASSERT_TRUE(forward.ok()) << forward.status();
  EXPECT_TRUE(std::isfinite(forward->loss_mean));
  EXPECT_GT(forward->loss_mean, 0.0);
  absl::StatusOr<OptimStepResult> step = (*engine)->OptimStep("real", {});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->step, 1);
  EXPECT_FALSE(step->skipped) << step->skip_reason;
  EXPECT_GT(step->grad_norm, 0.0);
  EXPECT_FALSE(torch::equal(
      before, model.Find("model.layers.0.self_attn.q_proj.weight")->tensor));
}

INSTANTIATE_TEST_SUITE_P(HubConfigs, RealConfigTest,
                         ::testing::Values("llama-3.2-1b", "llama-3.1-8b",
                                           "qwen2.5-0.5b", "qwen2.5-7b",
                                           "qwen3-0.6b", "qwen3-8b",
                                           "mistral-7b-v0.3", "mixtral-8x7b"),
                         [](const ::testing::TestParamInfo<const char*>& p) {
                           std::string name = p.param;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch)))
                               ch = '_';
                           }
                           return name;
                         });

absl::Status Parse(const std::string& model_type, const nlohmann::json& extra) {
  return LlamaConfig::FromHfJson(testing::SmallConfigJson(model_type, extra))
      .status();
}

TEST(ModelFamilyTest, RefusesWhatItDoesNotImplementNamingTheField) {
  struct Case {
    const char* model_type;
    const char* extra;  // JSON fields added to a valid config
    const char* names;
  };
  const std::vector<Case> cases = {
      {"llama", R"({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})",
       "rope_scaling"},
      {"llama", R"({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})",
       "rope_scaling"},
      {"llama", R"({"rope_scaling": {"rope_type": "linear"}})",
       "rope_scaling.factor"},
      {"llama",
       R"({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
           "low_freq_factor": 4.0, "high_freq_factor": 1.0,
           "original_max_position_embeddings": 64}})",
       "rope_scaling.high_freq_factor"},
      {"llama", R"({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})",
       "rope_scaling"},
      {"llama", R"({"partial_rotary_factor": 0.5})", "partial_rotary_factor"},
      {"llama",
       R"({"rope_parameters": {"rope_type": "default",
           "partial_rotary_factor": 0.25}})",
       "rope_parameters.partial_rotary_factor"},
      {"llama", R"({"rope_parameters": 10000.0})", "rope_parameters"},
      {"llama", R"({"hidden_act": "gelu"})", "hidden_act"},
      {"llama", R"({"attention_dropout": 0.1})", "attention_dropout"},
      {"llama", R"({"quantization_config": {"bits": 4}})",
       "quantization_config"},
      {"qwen2", R"({"use_mrope": true})", "use_mrope"},
      {"qwen2",
       R"({"use_sliding_window": true, "sliding_window": 4,
           "layer_types": ["sliding_attention", "full_attention"]})",
       "layer_types"},
      {"qwen2", R"({"layer_types": ["full_attention"]})", "layer_types"},
      {"mixtral", R"({"router_jitter_noise": 0.1})", "router_jitter_noise"},
      {"gemma", "{}", "model_type"},
      {"llama", R"({"head_dim": 7})", "head_dim"},
  };
  for (const Case& c : cases) {
    const absl::Status status =
        Parse(c.model_type, nlohmann::json::parse(c.extra));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.extra;
    EXPECT_THAT(status.message(), HasSubstr(c.names)) << c.extra;
  }
}

// Through the API (CreateModel's ModelConfig): a family's fields are
// checked against the family.
TEST(ModelFamilyTest, RefusesFieldsTheFamilyDoesNotHave) {
  struct Case {
    const char* model_type;
    void (*set)(LlamaConfig&);
    const char* names;
  };
  const std::vector<Case> cases = {
      {"qwen2", [](LlamaConfig& c) { c.attention_bias = true; },
       "config.attention_bias"},
      {"qwen3", [](LlamaConfig& c) { c.mlp_bias = true; }, "config.mlp_bias"},
      {"mistral", [](LlamaConfig& c) { c.attention_bias = true; },
       "config.attention_bias"},
      {"llama", [](LlamaConfig& c) { c.sliding_window = 8; },
       "config.sliding_window"},
      {"mistral", [](LlamaConfig& c) { c.max_window_layers = 1; },
       "config.max_window_layers"},
      {"qwen3", [](LlamaConfig& c) { c.num_local_experts = 4; },
       "config.num_local_experts"},
      {"llama", [](LlamaConfig& c) { c.output_router_logits = true; },
       "config.output_router_logits"},
      {"nope", [](LlamaConfig&) {}, "config.model_type"},
  };
  for (const Case& c : cases) {
    LlamaConfig config = testing::TinyConfig();
    config.model_type = c.model_type;
    c.set(config);
    const absl::Status status = config.WithDefaults().Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
        << c.model_type;
    EXPECT_THAT(status.message(), HasSubstr(c.names)) << c.model_type;
  }
}

TEST(ModelFamilyTest, FamiliesFillTransformersDefaultsForOmittedFields) {
  // Qwen3Config: head_dim 128; MistralConfig: sliding_window 4096;
  // MixtralConfig: rope_theta 1e6, rms_norm_eps 1e-5, 8 experts, top 2,
  // router_aux_loss_coef 0.001 without output_router_logits.
  absl::StatusOr<LlamaConfig> qwen3 = LlamaConfig::FromHfJson(
      testing::SmallConfigJson("qwen3", nlohmann::json::object()));
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_EQ(qwen3->HeadDim(), 128);
  absl::StatusOr<LlamaConfig> mistral = LlamaConfig::FromHfJson(
      testing::SmallConfigJson("mistral", nlohmann::json::object()));
  ASSERT_TRUE(mistral.ok()) << mistral.status();
  EXPECT_EQ(mistral->sliding_window, 4096);
  absl::StatusOr<LlamaConfig> mixtral = LlamaConfig::FromHfJson(
      testing::SmallConfigJson("mixtral", nlohmann::json::object()));
  ASSERT_TRUE(mixtral.ok()) << mixtral.status();
  EXPECT_EQ(mixtral->rope_theta, 1e6);
  EXPECT_EQ(mixtral->rms_norm_eps, 1e-5);
  EXPECT_EQ(mixtral->num_local_experts, 8);
  EXPECT_EQ(mixtral->num_experts_per_tok, 2);
  EXPECT_EQ(mixtral->router_aux_loss_coef, 0.001);
  EXPECT_EQ(mixtral->load_balancing_coefficient(), 0.0);
}

// layer_types decides which layers slide, as in transformers: its
// full-attention prefix, or no layer when it lists no sliding one (whatever
// use_sliding_window and max_window_layers say).
TEST(ModelFamilyTest, QwenLayerTypesDecideWhichLayersSlide) {
  struct Case {
    const char* layer_types;
    int64_t max_window_layers;
    std::vector<int64_t> windows;
  };
  for (const Case& c :
       {Case{R"(["full_attention", "sliding_attention"])", 0, {0, 4}},
        Case{R"(["full_attention", "full_attention"])", 1, {0, 0}}}) {
    nlohmann::json fields = {{"use_sliding_window", true},
                             {"sliding_window", 4},
                             {"max_window_layers", c.max_window_layers}};
    fields["layer_types"] = nlohmann::json::parse(c.layer_types);
    absl::StatusOr<LlamaConfig> config =
        LlamaConfig::FromHfJson(testing::SmallConfigJson("qwen2", fields));
    ASSERT_TRUE(config.ok()) << config.status();
    const ModelFamily& family = **FindModelFamily("qwen2");
    for (int64_t layer = 0; layer < 2; ++layer) {
      EXPECT_EQ(family.AttentionWindow(*config, layer), c.windows[layer])
          << c.layer_types << " layer " << layer;
    }
  }
}

// transformers 5 moves rope_theta and the scaling into rope_parameters; it
// wins over the version-4 fields when a file has both.
TEST(ModelFamilyTest, ReadsTransformers5RopeParameters) {
  absl::StatusOr<LlamaConfig> c = LlamaConfig::FromHfJson(
      testing::SmallConfigJson("llama", nlohmann::json::parse(
                                            R"({"rope_theta": 10000.0,
                       "rope_parameters": {"rope_type": "llama3",
                         "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}})")));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.rope_type, "llama3");
  EXPECT_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);

  absl::StatusOr<LlamaConfig> plain =
      LlamaConfig::FromHfJson(testing::SmallConfigJson(
          "qwen3", nlohmann::json::parse(
                       R"({"rope_parameters": {"rope_type": "default",
                                           "rope_theta": 1000000.0}})")));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->rope_theta, 1000000.0);
  EXPECT_TRUE(plain->rope_scaling.rope_type.empty());
}

// A config-only CreateModel: the ModelConfig fields of the families reach
// the model's config, and ModelInfo gives them back.
TEST(ModelFamilyTest, ModelConfigCarriesTheFamilyFields) {
  v1::CreateModelRequest request;
  request.set_model_id("q");
  v1::ModelConfig* c = request.mutable_config();
  c->set_model_type("qwen3");
  c->set_vocab_size(64);
  c->set_hidden_size(32);
  c->set_intermediate_size(48);
  c->set_num_hidden_layers(2);
  c->set_num_attention_heads(4);
  c->set_num_key_value_heads(2);
  c->set_head_dim(12);
  c->set_attention_bias(true);
  c->set_sliding_window(6);
  c->set_max_window_layers(1);
  c->mutable_rope_scaling()->set_rope_type("linear");
  c->mutable_rope_scaling()->set_factor(4.0);
  absl::StatusOr<ModelSpec> spec = ParseCreateModel(request);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const LlamaConfig& config = spec->config;
  EXPECT_EQ(config.model_type, "qwen3");
  EXPECT_EQ(config.HeadDim(), 12);
  EXPECT_TRUE(config.attention_bias);
  EXPECT_EQ(config.sliding_window, 6);
  EXPECT_EQ(config.max_window_layers, 1);
  EXPECT_EQ(config.rope_scaling.rope_type, "linear");
  EXPECT_EQ(config.rope_scaling.factor, 4.0);
  ModelSummary summary;
  summary.config = config;
  v1::ModelInfo info;
  ToProto(summary, &info);
  request.mutable_config()->CopyFrom(info.config());
  absl::StatusOr<ModelSpec> again = ParseCreateModel(request);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->config == config);

  // A family field the family does not have names it.
  c = request.mutable_config();
  c->set_model_type("qwen2");
  EXPECT_THAT(std::string(ParseCreateModel(request).status().message()),
              HasSubstr("config.attention_bias"));
  c->set_model_type("falcon");
  EXPECT_EQ(ParseCreateModel(request).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tally
