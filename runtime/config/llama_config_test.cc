// Model config ranges (docs/security.md): every numeric field out of its
// range is refused naming the field, from a config.json (text, or a
// checkpoint's file) and from CreateModel.config alike; a config that is
// accepted is reported by ModelInfo exactly as it runs.
#include "runtime/config/llama_config.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/checkpoint/checkpoint.h"
#include "server/convert.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

struct JsonCase {
  const char* model_type;
  const char* extra;  // JSON fields merged into a valid config
  const char* field;  // what the error must name
};

// config.json values that do not fit the field: negative or zero sizes,
// values beyond int32 (which ModelConfig reports), non-positive floats. (JSON
// has no non-finite numbers: the parser refuses 1e999.)
const std::vector<JsonCase>& OutOfRangeJson() {
  static const auto* cases = new std::vector<JsonCase>{
      {"llama", R"({"head_dim": -8})", "config.head_dim"},
      // 2^64 - 8: read as int64 it would wrap to -8.
      {"llama", R"({"head_dim": 18446744073709551608})", "head_dim"},
      {"llama", R"({"max_position_embeddings": 4294967808})",
       "config.max_position_embeddings"},
      {"llama", R"({"max_position_embeddings": -1})",
       "config.max_position_embeddings"},
      {"mistral", R"({"sliding_window": 4294967297})", "config.sliding_window"},
      {"mistral", R"({"sliding_window": -4})", "config.sliding_window"},
      {"qwen2", R"({"use_sliding_window": true, "sliding_window": 4294967297})",
       "config.sliding_window"},
      {"qwen3", R"({"max_window_layers": -1})", "config.max_window_layers"},
      {"qwen2", R"({"max_window_layers": 4294967296})",
       "config.max_window_layers"},
      {"llama", R"({"vocab_size": 0})", "config.vocab_size"},
      {"llama", R"({"hidden_size": -32})", "config.hidden_size"},
      {"llama", R"({"intermediate_size": 4294967344})",
       "config.intermediate_size"},
      {"llama", R"({"num_hidden_layers": 4294967298})",
       "config.num_hidden_layers"},
      {"llama", R"({"num_key_value_heads": -2})", "config.num_key_value_heads"},
      {"llama", R"({"num_key_value_heads": 3})", "config.num_key_value_heads"},
      {"qwen3", R"({"head_dim": 4294967424})", "config.head_dim"},
      {"mixtral", R"({"num_local_experts": 4294967300})",
       "config.num_local_experts"},
      {"mixtral", R"({"num_experts_per_tok": -1})",
       "config.num_experts_per_tok"},
      {"mixtral", R"({"router_aux_loss_coef": -0.5})",
       "config.router_aux_loss_coef"},
      {"llama", R"({"rms_norm_eps": -1e-6})", "config.rms_norm_eps"},
      {"llama", R"({"rope_theta": -10000.0})", "config.rope_theta"},
      {"llama", R"({"rope_scaling": {"rope_type": "linear", "factor": -2.0}})",
       "config.rope_scaling.factor"},
      {"llama",
       R"({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 4294975488}})",
       "config.rope_scaling.original_max_position_embeddings"},
  };
  return *cases;
}

TEST(ConfigRangeTest, ConfigJsonOutOfRangeIsRefusedNamingTheField) {
  for (const JsonCase& c : OutOfRangeJson()) {
    const absl::Status status =
        LlamaConfig::FromHfJson(
            testing::SmallConfigJson(c.model_type,
                                     nlohmann::json::parse(c.extra)))
            .status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.extra;
    EXPECT_THAT(std::string(status.message()), HasSubstr("config.json"))
        << c.extra;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field)) << c.extra;
  }
  // The value is quoted as the file has it, not as it would wrap.
  EXPECT_THAT(
      std::string(LlamaConfig::FromHfJson(
                      testing::SmallConfigJson(
                          "llama", {{"head_dim", 18446744073709551608u}}))
                      .status()
                      .message()),
      Not(HasSubstr("-8")));
}

// A checkpoint's (or HF directory's) config.json goes through the same
// checks, the family-specific fields included.
TEST(ConfigRangeTest, CheckpointConfigJsonIsCheckedToo) {
  std::string pattern =
      (fs::path(::testing::TempDir()) / "config_range_XXXXXX").string();
  ASSERT_NE(mkdtemp(pattern.data()), nullptr);
  const std::string dir = pattern;
  for (const JsonCase& c :
       {JsonCase{"llama", R"({"head_dim": -8})", "config.head_dim"},
        JsonCase{"mistral", R"({"sliding_window": 4294967297})",
                 "config.sliding_window"}}) {
    std::ofstream(dir + "/config.json") << testing::SmallConfigJson(
        c.model_type, nlohmann::json::parse(c.extra));
    const absl::Status status = ReadCheckpoint(dir, false).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.extra;
    EXPECT_THAT(std::string(status.message()), HasSubstr("config.json"))
        << c.extra;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field)) << c.extra;
  }
  fs::remove_all(dir);
}

v1::CreateModelRequest SmallRequest(const std::string& model_type) {
  v1::CreateModelRequest request;
  request.set_model_id("m");
  v1::ModelConfig* c = request.mutable_config();
  c->set_model_type(model_type);
  c->set_vocab_size(64);
  c->set_hidden_size(32);
  c->set_intermediate_size(48);
  c->set_num_hidden_layers(2);
  c->set_num_attention_heads(4);
  c->set_num_key_value_heads(2);
  return request;
}

TEST(ConfigRangeTest, CreateModelConfigOutOfRangeIsRefusedNamingTheField) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
  struct Case {
    const char* model_type;
    std::function<void(v1::ModelConfig&)> set;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"llama", [](v1::ModelConfig& c) { c.set_head_dim(-8); },
       "config.head_dim"},
      {"llama", [](v1::ModelConfig& c) { c.set_vocab_size(-1); },
       "config.vocab_size"},
      {"llama", [](v1::ModelConfig& c) { c.set_intermediate_size(0); },
       "config.intermediate_size"},
      {"llama", [](v1::ModelConfig& c) { c.set_num_hidden_layers(5000); },
       "config.num_hidden_layers"},
      {"llama", [](v1::ModelConfig& c) { c.set_num_attention_heads(-4); },
       "config.num_attention_heads"},
      {"llama", [](v1::ModelConfig& c) { c.set_num_key_value_heads(-2); },
       "config.num_key_value_heads"},
      {"llama", [](v1::ModelConfig& c) { c.set_max_position_embeddings(-5); },
       "config.max_position_embeddings"},
      {"mistral", [](v1::ModelConfig& c) { c.set_sliding_window(-1); },
       "config.sliding_window"},
      {"qwen2", [](v1::ModelConfig& c) { c.set_max_window_layers(-1); },
       "config.max_window_layers"},
      {"llama", [](v1::ModelConfig& c) { c.set_rms_norm_eps(kNan); },
       "config.rms_norm_eps"},
      {"llama", [](v1::ModelConfig& c) { c.set_rms_norm_eps(kInf); },
       "config.rms_norm_eps"},
      {"llama", [](v1::ModelConfig& c) { c.set_rope_theta(-kInf); },
       "config.rope_theta"},
      {"mixtral",
       [](v1::ModelConfig& c) {
         c.set_num_local_experts(4);
         c.set_router_aux_loss_coef(kNan);
       },
       "config.router_aux_loss_coef"},
      {"mixtral", [](v1::ModelConfig& c) { c.set_num_local_experts(5000); },
       "config.num_local_experts"},
      {"mixtral",
       [](v1::ModelConfig& c) {
         c.set_num_local_experts(4);
         c.set_num_experts_per_tok(-1);
       },
       "config.num_experts_per_tok"},
      // Scaling parameters the type does not use are refused, not dropped.
      {"llama",
       [](v1::ModelConfig& c) { c.mutable_rope_scaling()->set_factor(4); },
       "config.rope_scaling.factor"},
      {"llama",
       [](v1::ModelConfig& c) {
         c.mutable_rope_scaling()->set_rope_type("linear");
         c.mutable_rope_scaling()->set_factor(4);
         c.mutable_rope_scaling()->set_low_freq_factor(1);
       },
       "config.rope_scaling.low_freq_factor"},
      {"llama",
       [](v1::ModelConfig& c) {
         c.mutable_rope_scaling()->set_rope_type("default");
         c.mutable_rope_scaling()->set_original_max_position_embeddings(8192);
       },
       "config.rope_scaling.original_max_position_embeddings"},
      {"llama",
       [](v1::ModelConfig& c) {
         v1::RopeScaling* r = c.mutable_rope_scaling();
         r->set_rope_type("llama3");
         r->set_factor(8);
         r->set_low_freq_factor(1);
         r->set_high_freq_factor(4);
         r->set_original_max_position_embeddings(-8192);
       },
       "config.rope_scaling.original_max_position_embeddings"},
  };
  for (const Case& c : cases) {
    v1::CreateModelRequest request = SmallRequest(c.model_type);
    c.set(*request.mutable_config());
    const absl::Status status = ParseCreateModel(request).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
  }
}

// What ModelInfo reports for `config` (as the engine keeps it), read back
// as a CreateModel config.
LlamaConfig ReportedAndReread(const LlamaConfig& config) {
  ModelSummary summary;
  summary.config = config;
  v1::ModelInfo info;
  ToProto(summary, &info);
  EXPECT_EQ(info.config().head_dim(), config.HeadDim());
  EXPECT_EQ(info.config().max_position_embeddings(),
            config.max_position_embeddings);
  EXPECT_EQ(info.config().sliding_window(), config.sliding_window);
  if (config.rope_scaling.rope_type != "llama3") {
    EXPECT_EQ(info.config().rope_scaling().original_max_position_embeddings(),
              0);
  }
  // And its config.json.
  absl::StatusOr<LlamaConfig> reread =
      LlamaConfig::FromHfJson(config.ToHfJson("float32"));
  EXPECT_TRUE(reread.ok() && *reread == config) << reread.status();
  v1::CreateModelRequest request;
  *request.mutable_config() = info.config();
  absl::StatusOr<ModelSpec> spec = ParseCreateModel(request);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? spec->config : LlamaConfig();
}

// Valid HF values at the top of their ranges are kept, and ModelInfo
// reports what runs: head_dim that differs from hidden_size / heads, long
// contexts, rope_theta 1e6, int32's largest max_position_embeddings; a
// linear rope_scaling ignores llama3 parameters, as transformers does.
TEST(ConfigRangeTest, AcceptedConfigsAreReportedExactlyAsTheyRun) {
  for (const auto& [model_type, extra] :
       std::vector<std::pair<const char*, const char*>>{
           {"qwen3", R"({"head_dim": 128, "max_position_embeddings": 40960,
                         "rope_theta": 1000000.0, "rms_norm_eps": 1e-6})"},
           {"mistral", R"({"sliding_window": 131072,
                           "max_position_embeddings": 2147483647})"},
           {"qwen2", R"({"use_sliding_window": true, "sliding_window": 32768,
                         "max_window_layers": 70,
                         "max_position_embeddings": 1000000})"},
           {"llama", R"({"rope_theta": 500000.0,
                         "max_position_embeddings": 131072,
                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}})"},
           {"llama", R"({"rope_scaling": {"rope_type": "linear",
                           "factor": 2.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 4096}})"},
           {"mixtral", R"({"num_local_experts": 8, "num_experts_per_tok": 2,
                           "router_aux_loss_coef": 0.02,
                           "output_router_logits": true})"}}) {
    absl::StatusOr<LlamaConfig> config = LlamaConfig::FromHfJson(
        testing::SmallConfigJson(model_type, nlohmann::json::parse(extra)));
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_TRUE(ReportedAndReread(*config) == *config) << extra;
  }
}

}  // namespace
}  // namespace tally
