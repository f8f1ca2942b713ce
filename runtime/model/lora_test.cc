// LoRA adapters over a shared, frozen base (runtime/model/lora.h): adapters on
// one base share its tensors and train as if each were alone; the base never
// changes and lives while an adapter uses it; checkpoints hold the adapter;
// exports write PEFT's files or the merged model.
#include "runtime/model/lora.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/lora_adapter_reader.h"
#include "runtime/config/memory_estimate.h"
#include "runtime/engine/engine.h"
#include "runtime/io/safetensors.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/golden.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::MakeSamples;
using testing::TinySpec;

constexpr int64_t kVocab = 48;

ModelSpec LoraSpec(const std::string& id, DType dtype, int64_t rank,
                   uint64_t lora_seed) {
  ModelSpec spec = TinySpec(id, dtype, OptimizerKind::kAdamW);
  spec.lora.rank = rank;
  spec.lora.alpha = 3.0 * rank;
  spec.lora.seed = lora_seed;
  return spec;
}

// Copies of a model's tensors by name (of its LoRA factors, or of the rest).
std::map<std::string, torch::Tensor> Tensors(const CausalLm& model,
                                             bool factors) {
  std::map<std::string, torch::Tensor> out;
  for (const Parameter& p : model.parameters()) {
    if (IsLoraParameter(p.name) == factors) {
      out[p.name] = p.tensor.detach().clone();
    }
  }
  return out;
}

void ExpectBitwiseEqual(const std::map<std::string, torch::Tensor>& a,
                        const std::map<std::string, torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
  }
}

class LoraTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::path(::testing::TempDir()) / "lora_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
  }
  void TearDown() override { fs::remove_all(root_); }

  // One window of two calls on `id`, from samples of `seed`; its losses.
  static std::vector<double> Window(Engine& engine, const std::string& id,
                                    uint64_t seed) {
    std::vector<double> losses;
    for (uint64_t call = 0; call < 2; ++call) {
      ForwardBackwardArgs args{MakeSamples(kVocab, {5, 3}, seed + call)};
      losses.push_back(engine.ForwardBackward(id, args).value().loss_sum);
    }
    losses.push_back(engine.OptimStep(id, {}).value().grad_norm);
    return losses;
  }

  std::string root_;
};

// Two adapters of different ranks on one base, their calls interleaved,
// end bitwise where each ends trained alone on an engine of its own.
class LoraInterleavedTest : public LoraTest,
                            public ::testing::WithParamInterface<DType> {};

TEST_P(LoraInterleavedTest, AdaptersTrainedInterleavedEqualEachAlone) {
  const DType dtype = GetParam();
  const ModelSpec a = LoraSpec("a", dtype, 2, 11);
  const ModelSpec b = LoraSpec("b", dtype, 4, 12);
  auto shared = Engine::CreateSingleRank({}).value();
  ASSERT_TRUE(shared->CreateModel(a).ok());
  ASSERT_TRUE(shared->CreateModel(b).ok());
  // Calls alternate between the adapters, windows overlapping.
  std::vector<double> a_losses, b_losses;
  for (uint64_t window = 0; window < 3; ++window) {
    for (uint64_t call = 0; call < 2; ++call) {
      for (auto [id, losses] : {std::pair{"a", &a_losses}, {"b", &b_losses}}) {
        ForwardBackwardArgs args{
            MakeSamples(kVocab, {5, 3}, 100 * window + call)};
        losses->push_back(shared->ForwardBackward(id, args).value().loss_sum);
      }
    }
    a_losses.push_back(shared->OptimStep("a", {}).value().grad_norm);
    b_losses.push_back(shared->OptimStep("b", {}).value().grad_norm);
  }
  for (const ModelSpec& spec : {a, b}) {
    auto alone = Engine::CreateSingleRank({}).value();
    ASSERT_TRUE(alone->CreateModel(spec).ok());
    std::vector<double> losses;
    for (uint64_t window = 0; window < 3; ++window) {
      for (double x : Window(*alone, spec.model_id, 100 * window)) {
        losses.push_back(x);
      }
    }
    EXPECT_EQ(losses, spec.model_id == "a" ? a_losses : b_losses);
    ExpectBitwiseEqual(
        Tensors(*EngineTestPeer::Model(*shared, spec.model_id).value(),
                /*factors=*/true),
        Tensors(*EngineTestPeer::Model(*alone, spec.model_id).value(),
                /*factors=*/true));
  }
  // The factors moved (B starts at zero), the base did not: it is still the
  // seed's draw, one set of tensors for both adapters.
  EXPECT_GT(a_losses.back(), 0.0);
  ModelSpec full = TinySpec("full", dtype, OptimizerKind::kAdamW);
  ASSERT_TRUE(shared->CreateModel(full).ok());
  const auto base =
      Tensors(*EngineTestPeer::Model(*shared, "full").value(), false);
  ExpectBitwiseEqual(
      Tensors(*EngineTestPeer::Model(*shared, "a").value(), false), base);
  const CausalLm& model_a = *EngineTestPeer::Model(*shared, "a").value();
  const CausalLm& model_b = *EngineTestPeer::Model(*shared, "b").value();
  ASSERT_NE(model_a.base(), nullptr);
  EXPECT_EQ(model_a.base(), model_b.base());
  EXPECT_EQ(model_a.Find("model.norm.weight")->tensor.data_ptr(),
            model_b.Find("model.norm.weight")->tensor.data_ptr());
  EXPECT_EQ(shared->GetModel("a")->base, shared->GetModel("b")->base);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LoraInterleavedTest,
                         ::testing::Values(DType::kFloat64, DType::kFloat32),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST_F(LoraTest, BaseLivesWhileAnAdapterUsesIt) {
  auto engine = Engine::CreateSingleRank({}).value();
  const ModelSpec a = LoraSpec("a", DType::kFloat32, 2, 1);
  ASSERT_TRUE(engine->CreateModel(a).ok());
  ASSERT_TRUE(engine->CreateModel(LoraSpec("b", DType::kFloat32, 2, 2)).ok());
  const std::string key = engine->GetModel("a")->base;
  EXPECT_FALSE(key.empty());
  std::weak_ptr<const CausalLm> base =
      EngineTestPeer::Model(*engine, "a").value()->base();
  ASSERT_TRUE(engine->DeleteModel("a").ok());
  EXPECT_TRUE(engine->HasBase(key));
  ASSERT_TRUE(engine->DeleteModel("b").ok());
  EXPECT_FALSE(engine->HasBase(key));
  EXPECT_TRUE(base.expired());
  // Another seed or dtype is another base.
  ModelSpec other = a;
  other.seed = 99;
  ASSERT_TRUE(engine->CreateModel(other).ok());
  EXPECT_NE(engine->GetModel("a")->base, key);
}

TEST_F(LoraTest, BasesAreSharedWithinATenantAndOneSpellingOfAPath) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec full = TinySpec("full", DType::kFloat32, OptimizerKind::kAdamW);
  ASSERT_TRUE(engine->CreateModel(full).ok());
  ASSERT_TRUE(engine->ExportWeights("full", root_ + "/base").ok());
  auto create = [&](const std::string& id, const std::string& path) {
    ModelSpec spec = LoraSpec(id, DType::kFloat32, 2, 1);
    spec.config = LlamaConfig();
    spec.init_checkpoint = path;
    EXPECT_TRUE(engine->CreateModel(spec).ok()) << id;
    return engine->GetModel(id)->base;
  };
  const std::string a = create("t1/a", root_ + "/base");
  EXPECT_EQ(create("t1/b", root_ + "//base/"), a);
  EXPECT_NE(create("t2/c", root_ + "/base"), a);
  EXPECT_NE(create("d", root_ + "/base"), a);
}

// A base is what its directory held when it was read: a model exported over
// the directory later is another base (read from the new contents), and
// the adapters on the first one keep theirs. Before, every adapter created
// over the path got the first base, whatever config.json said by then.
TEST_F(LoraTest, AnExportOverABaseDirectoryIsAnotherBase) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec big = TinySpec("big", DType::kFloat32, OptimizerKind::kAdamW);
  big.config.hidden_size = 64;
  big.config.intermediate_size = 96;
  ModelSpec tiny = TinySpec("tiny", DType::kFloat32, OptimizerKind::kAdamW);
  ASSERT_TRUE(engine->CreateModel(big).ok());
  ASSERT_TRUE(engine->CreateModel(tiny).ok());
  const std::string dir = root_ + "/b";
  ASSERT_TRUE(engine->ExportWeights("big", dir).ok());
  auto create = [&](const std::string& id) {
    ModelSpec spec = LoraSpec(id, DType::kFloat32, 2, 1);
    spec.config = LlamaConfig();
    spec.init_checkpoint = dir;
    const absl::StatusOr<ModelSummary> created = engine->CreateModel(spec);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.value_or(ModelSummary());
  };
  const ModelSummary first = create("first");
  EXPECT_EQ(first.config, big.config.WithDefaults());
  EXPECT_EQ(engine->BaseConfig(first.base), big.config.WithDefaults());
  ASSERT_TRUE(engine->ExportWeights("tiny", dir).ok());
  const ModelSummary second = create("second");
  EXPECT_NE(second.base, first.base);
  EXPECT_EQ(second.config, tiny.config.WithDefaults());
  EXPECT_EQ(engine->BaseConfig(second.base), tiny.config.WithDefaults());
  EXPECT_NE(EngineTestPeer::Model(*engine, "second").value()->base(),
            EngineTestPeer::Model(*engine, "first").value()->base());
  EXPECT_EQ(EngineTestPeer::Model(*engine, "second").value()->config(),
            tiny.config.WithDefaults());
  // The directory unchanged since: the same base.
  const ModelSummary third = create("third");
  EXPECT_EQ(third.base, second.base);
  EXPECT_EQ(EngineTestPeer::Model(*engine, "third").value()->base(),
            EngineTestPeer::Model(*engine, "second").value()->base());
  // The first adapter keeps its base, and trains on it.
  EXPECT_EQ(engine->GetModel("first")->config, big.config.WithDefaults());
  EXPECT_EQ(Window(*engine, "first", 5).size(), 3u);
}

// Every rank reads the base directory's identity itself, so ranks can read
// different contents (a directory published over between their reads; here
// each rank is pointed at another export): they refuse the adapter together
// with ABORTED, and none builds or shares a base the others do not.
TEST(LoraRanksTest, RanksThatReadDifferentBasesRefuseTogether) {
  testing::RunOnRanks(2, [](const RankEnv& env) -> absl::Status {
    MeshShape shape;
    shape.dp_replicate = 2;
    TALLY_ASSIGN_OR_RETURN(auto engine,
                           testing::CreateRankEngine(shape, env, {}));
    const std::string root = absl::StrCat(::testing::TempDir(),
                                          "tally_lora_ranks_", env.master_port);
    for (const char* id : {"a", "b"}) {
      ModelSpec spec = TinySpec(id, DType::kFloat32, OptimizerKind::kAdamW,
                                /*seed=*/id[0]);
      TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
      TALLY_RETURN_IF_ERROR(
          engine->ExportWeights(id, absl::StrCat(root, "/", id)).status());
    }
    ModelSpec spec = LoraSpec("adapter", DType::kFloat32, 2, 1);
    spec.config = LlamaConfig();
    spec.init_checkpoint = root + (env.rank == 0 ? "/a" : "/b");
    const absl::Status refused = engine->CreateModel(spec).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << refused;
    EXPECT_EQ(engine->num_models(), 2u);
    spec.init_checkpoint = root + "/a";
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    EXPECT_EQ(engine->num_models(), 3u);
    if (env.rank == 0) fs::remove_all(root);  // every rank has read it
    return absl::OkStatus();
  });
}

TEST_F(LoraTest, SummaryCountsTheAdapter) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec = LoraSpec("a", DType::kFloat64, 4, 1);
  spec.lora.train_mlp = false;
  const ModelSummary s = engine->CreateModel(spec).value();
  // q [32, 32], k and v [16, 32], o [32, 32] per layer (8 x 4 query and
  // 8 x 2 key-value heads), lm_head [48, 32].
  const uint64_t per_layer = 4 * ((32 + 32) + 2 * (16 + 32) + (32 + 32));
  const uint64_t expected = 2 * per_layer + 4 * (32 + 48);
  EXPECT_EQ(s.trainable_parameters, expected);
  EXPECT_EQ(s.trainable_bytes, 8 * expected);
  uint64_t held = 0;
  for (const Parameter& p :
       EngineTestPeer::Model(*engine, "a").value()->parameters()) {
    if (p.trainable) held += p.tensor.numel();
  }
  EXPECT_EQ(held, expected);
  EXPECT_EQ(s.lora.alpha, 12.0);
}

TEST_F(LoraTest, PeftExportReimportsBitwise) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec = LoraSpec("a", DType::kFloat64, 4, 1);
  ASSERT_TRUE(engine->CreateModel(spec).ok());
  Window(*engine, "a", 1);
  Window(*engine, "a", 2);
  const std::string dir = root_ + "/peft";
  const ExportResult exported = engine->ExportWeights("a", dir).value();
  EXPECT_THAT(
      exported.files,
      ::testing::ElementsAre("adapter_config.json", "adapter_model.safetensors",
                             "checksums.sha256"));
  std::ifstream config_file(dir + "/adapter_config.json");
  const nlohmann::json config = nlohmann::json::parse(config_file);
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["r"], 4);
  EXPECT_EQ(config["lora_alpha"], 12.0);
  EXPECT_EQ(config["target_modules"],
            nlohmann::json({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                            "up_proj", "down_proj", "lm_head"}));
  const NamedTensors file =
      ReadSafetensors(dir + "/adapter_model.safetensors").value();
  const auto factors =
      Tensors(*EngineTestPeer::Model(*engine, "a").value(), true);
  ASSERT_EQ(file.size(), factors.size());
  for (const auto& [name, t] : file) {
    ASSERT_TRUE(absl::StartsWith(name, "base_model.model.")) << name;
    EXPECT_TRUE(torch::equal(
        t, factors.at(name.substr(sizeof("base_model.model.") - 1))))
        << name;
  }

  ModelSpec again = LoraSpec("again", DType::kFloat64, 4, 7);
  again.lora.init_adapter = dir;
  ASSERT_TRUE(engine->CreateModel(again).ok());
  ExpectBitwiseEqual(
      Tensors(*EngineTestPeer::Model(*engine, "again").value(), true), factors);

  ModelSpec wrong = again;
  wrong.model_id = "wrong";
  wrong.lora.rank = 2;
  absl::Status refused = engine->CreateModel(wrong).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("lora.init_adapter"));
  EXPECT_FALSE(engine->GetModel("wrong").ok());
  // A field of the wrong JSON type is a refusal too, not an exception.
  std::ofstream(dir + "/adapter_config.json")
      << R"({"peft_type": "LORA", "r": "4", "bias": null})";
  wrong.lora.rank = 4;
  refused = engine->CreateModel(wrong).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("wrong type"));
}

// A PEFT adapter directory is read within bounds: an adapter_config.json
// nested far deeper than nlohmann's recursive copy can go is refused naming
// the file and field, and a factor the header declares at 64 GiB is refused
// from the header, naming its expected shape, before anything is allocated.
TEST_F(LoraTest, AdapterFilesAreBoundedAndCheckedBeforeAllocating) {
  const LlamaConfig config = testing::TinyConfig();
  LoraConfig lora;
  lora.rank = 4;
  lora = lora.WithDefaults();
  const std::string dir = root_ + "/peft";
  fs::create_directories(dir);

  std::ofstream(dir + "/adapter_config.json")
      << R"({"peft_type": "LORA", "r": 4, "target_modules": )"
      << std::string(300000, '[') << std::string(300000, ']') << "}";
  absl::Status status = ReadAdapter(dir, config, lora).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("lora.init_adapter " + dir));
  EXPECT_THAT(status.message(),
              HasSubstr("adapter_config.json nests arrays and objects deeper "
                        "than 64 levels (at target_modules[][]"));
  EXPECT_LE(status.message().size(), 600u);

  std::ofstream(dir + "/adapter_config.json") << PeftAdapterConfig(lora, "");
  const std::string factor =
      "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
  ASSERT_TRUE(testing::WriteSparseSafetensors(
      dir + "/adapter_model.safetensors", factor, {int64_t{1} << 24, 1024}));
  status = ReadAdapter(dir, config, lora).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("adapter factor " + factor +
                        " has shape [16777216, 1024], expected [4, 32]"));
}

TEST_F(LoraTest, MergedExportIsTheBasePlusTheScaledProduct) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec = LoraSpec("a", DType::kFloat64, 4, 1);
  ASSERT_TRUE(engine->CreateModel(spec).ok());
  Window(*engine, "a", 1);
  Window(*engine, "a", 2);
  ExportOptions options;
  options.merge = true;
  const std::string dir = root_ + "/merged";
  ASSERT_TRUE(engine->ExportWeights("a", dir, options).ok());
  std::map<std::string, torch::Tensor> merged;
  const NamedTensors file = ReadSafetensors(dir + "/model.safetensors").value();
  for (const auto& [name, t] : file) merged[name] = t;
  const CausalLm& model = *EngineTestPeer::Model(*engine, "a").value();
  const double scaling = 12.0 / 4;
  for (const Parameter& p : model.parameters()) {
    if (IsLoraParameter(p.name)) {
      EXPECT_FALSE(merged.count(p.name)) << p.name;
      continue;
    }
    const std::string module = p.name.substr(0, p.name.rfind(".weight"));
    const Parameter* a = model.Find(module + ".lora_A.weight");
    torch::Tensor expected = p.tensor;
    if (a != nullptr) {
      const Parameter* b = model.Find(module + ".lora_B.weight");
      expected = p.tensor + scaling * torch::matmul(b->tensor, a->tensor);
    }
    EXPECT_LT(testing::RelativeDiff(merged.at(p.name), expected), 1e-15)
        << p.name;
  }
  // And computes what the adapter does.
  ModelSpec full = TinySpec("merged", DType::kFloat64, OptimizerKind::kAdamW);
  full.config = LlamaConfig();
  full.init_checkpoint = dir;
  ASSERT_TRUE(engine->CreateModel(full).ok());
  ForwardBackwardArgs args{MakeSamples(kVocab, {6, 4}, 77)};
  args.forward_only = true;
  EXPECT_LT(
      testing::RelativeDiff(engine->ForwardBackward("merged", args)->loss_sum,
                            engine->ForwardBackward("a", args)->loss_sum),
      1e-12);
  // A model without an adapter has nothing to merge.
  EXPECT_EQ(
      engine->ExportWeights("merged", root_ + "/x", options).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// Every family the projection seam serves: a fresh adapter (B = 0)
// computes its base exactly, and a trained one computes what its merged
// export, a plain model of the family, computes: q/k/v biases (qwen2), q/k
// norms and an explicit head_dim (qwen3), sliding windows (mistral, qwen2),
// a tied head.
class LoraFamilyTest : public LoraTest,
                       public ::testing::WithParamInterface<const char*> {};

TEST_P(LoraFamilyTest, AdapterIsItsBaseThenItsMergedModel) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec full = TinySpec("full", DType::kFloat64, OptimizerKind::kAdamW);
  full.config.model_type = GetParam();
  full.config.tie_word_embeddings = full.config.model_type == "qwen2";
  full.config.sliding_window = full.config.model_type == "llama" ? 0 : 3;
  if (full.config.model_type == "qwen3") {
    full.config.head_dim = 12;
    full.config.attention_bias = true;
  }
  ASSERT_TRUE(engine->CreateModel(full).ok());
  ModelSpec spec = full;
  spec.model_id = "a";
  spec.lora.rank = 3;
  spec.lora.alpha = 6;
  ASSERT_TRUE(engine->CreateModel(spec).ok());
  ForwardBackwardArgs probe{MakeSamples(kVocab, {7, 5}, 5)};
  probe.forward_only = true;
  EXPECT_EQ(engine->ForwardBackward("a", probe)->loss_sum,
            engine->ForwardBackward("full", probe)->loss_sum);

  Window(*engine, "a", 1);
  Window(*engine, "a", 2);
  ExportOptions merge;
  merge.merge = true;
  ASSERT_TRUE(engine->ExportWeights("a", root_ + "/merged", merge).ok());
  ModelSpec merged = TinySpec("merged", DType::kFloat64, OptimizerKind::kAdamW);
  merged.config = LlamaConfig();
  merged.init_checkpoint = root_ + "/merged";
  ASSERT_TRUE(engine->CreateModel(merged).ok());
  const double adapted = engine->ForwardBackward("a", probe)->loss_sum;
  EXPECT_NE(adapted, engine->ForwardBackward("full", probe)->loss_sum);
  EXPECT_LT(testing::RelativeDiff(
                engine->ForwardBackward("merged", probe)->loss_sum, adapted),
            1e-12);
}

INSTANTIATE_TEST_SUITE_P(Families, LoraFamilyTest,
                         ::testing::Values("llama", "qwen2", "qwen3",
                                           "mistral"));

TEST_F(LoraTest, CheckpointHoldsTheAdapterAndLoadsOnlyIntoAnAdapter) {
  auto engine = Engine::CreateSingleRank({}).value();
  ASSERT_TRUE(engine->CreateModel(LoraSpec("a", DType::kFloat64, 2, 1)).ok());
  Window(*engine, "a", 1);
  Window(*engine, "a", 2);
  const std::string dir = root_ + "/ckpt";
  ASSERT_TRUE(engine->SaveCheckpoint("a", dir).ok());
  const NamedTensors file = ReadSafetensors(dir + "/model.safetensors").value();
  for (const auto& [name, t] : file) EXPECT_TRUE(IsLoraParameter(name)) << name;
  ASSERT_TRUE(engine->CreateModel(LoraSpec("b", DType::kFloat64, 2, 5)).ok());
  ASSERT_TRUE(engine->LoadCheckpoint("b", dir, /*load_optimizer=*/true).ok());
  ExpectBitwiseEqual(
      Tensors(*EngineTestPeer::Model(*engine, "b").value(), true),
      Tensors(*EngineTestPeer::Model(*engine, "a").value(), true));
  // Trained on alike, the two stay alike: the optimizer state came along.
  Window(*engine, "a", 3);
  Window(*engine, "b", 3);
  ExpectBitwiseEqual(
      Tensors(*EngineTestPeer::Model(*engine, "b").value(), true),
      Tensors(*EngineTestPeer::Model(*engine, "a").value(), true));

  // A full model's checkpoint would write into the shared base.
  ASSERT_TRUE(engine
                  ->CreateModel(
                      TinySpec("full", DType::kFloat64, OptimizerKind::kAdamW))
                  .ok());
  ASSERT_TRUE(engine->SaveCheckpoint("full", root_ + "/full").ok());
  const auto base =
      Tensors(*EngineTestPeer::Model(*engine, "a").value(), false);
  absl::Status refused =
      engine->LoadCheckpoint("a", root_ + "/full", true).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("LoRA"));
  ExpectBitwiseEqual(
      Tensors(*EngineTestPeer::Model(*engine, "a").value(), false), base);
  // An adapter checkpoint is no base to start from: the error says what is.
  ModelSpec from_adapter =
      TinySpec("from_adapter", DType::kFloat64, OptimizerKind::kAdamW);
  from_adapter.config = LlamaConfig();
  from_adapter.init_checkpoint = dir;
  refused = engine->CreateModel(from_adapter).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("holds a LoRA adapter"));
  // Nor does a checkpoint that says it holds an adapter but carries base
  // weights too.
  ModelAdapters unshared;
  unshared.lora = EngineTestPeer::Model(*engine, "a").value()->lora();
  std::unique_ptr<CausalLm> whole =
      CreateCausalLm(TinySpec("x", DType::kFloat64, OptimizerKind::kAdamW)
                         .config.WithDefaults(),
                     DType::kFloat64, 5, {}, unshared)
          .value();
  CheckpointManifest forged;
  forged.lora = unshared.lora;
  forged.trainable_only = true;
  ASSERT_TRUE(
      WriteCheckpoint(root_ + "/forged", *whole,
                      Optimizer(OptimizerKind::kAdamW, &whole->parameters()),
                      forged)
          .ok());
  refused = engine->LoadCheckpoint("a", root_ + "/forged", false).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  ExpectBitwiseEqual(
      Tensors(*EngineTestPeer::Model(*engine, "a").value(), false), base);
  // Nor does an adapter of another rank load, or an adapter into a full
  // model.
  ASSERT_TRUE(engine->CreateModel(LoraSpec("c", DType::kFloat64, 4, 5)).ok());
  EXPECT_EQ(engine->LoadCheckpoint("c", dir, true).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->LoadCheckpoint("full", dir, true).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// What a multi-rank writer builds to write an adapter: the base's parameters
// hold one element each (frozen, every element 0), the factors are drawn as
// in any adapter.
TEST_F(LoraTest, AdapterWriterHoldsNoBase) {
  const ModelSpec spec = LoraSpec("w", DType::kFloat64, 4, 9);
  const LlamaConfig config = spec.config.WithDefaults();
  ModelAdapters adapters;
  adapters.lora = spec.lora.WithDefaults();
  std::unique_ptr<CausalLm> drawn =
      CreateCausalLm(config, spec.dtype, spec.seed, {}, adapters).value();
  adapters.base_placeholders = true;
  std::unique_ptr<CausalLm> writer =
      CreateCausalLm(config, spec.dtype, spec.seed, {}, adapters).value();
  EXPECT_EQ(writer->NumParameters(), drawn->NumParameters());
  ExpectBitwiseEqual(Tensors(*writer, true), Tensors(*drawn, true));
  for (const Parameter& p : writer->parameters()) {
    if (IsLoraParameter(p.name)) continue;
    EXPECT_FALSE(p.trainable) << p.name;
    EXPECT_EQ(p.tensor.sizes(), drawn->Find(p.name)->tensor.sizes()) << p.name;
    EXPECT_EQ(p.tensor.storage().nbytes(), sizeof(double)) << p.name;
  }
  // Only an unsharded model takes placeholders.
  ModelSharding staged;
  staged.pp_stages = 2;
  EXPECT_FALSE(
      CreateCausalLm(config, spec.dtype, spec.seed, staged, adapters).ok());
}

TEST_F(LoraTest, RefusesWhatItCannotBuild) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec = LoraSpec("a", DType::kFloat32, 2, 1);
  spec.lora.alpha = -1;
  absl::Status status = engine->CreateModel(spec).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("lora.alpha"));
  spec.lora.alpha = 4;
  spec.lora.train_attn = spec.lora.train_mlp = spec.lora.train_unembed = false;
  EXPECT_THAT(engine->CreateModel(spec).status().message(),
              HasSubstr("lora.train_attn"));
  spec = LoraSpec("moe", DType::kFloat32, 2, 1);
  spec.config.num_local_experts = 4;
  spec.config.num_experts_per_tok = 2;
  status = engine->CreateModel(spec).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("lora.train_mlp"));
  spec.lora.train_mlp = false;
  EXPECT_TRUE(engine->CreateModel(spec).ok());
  EXPECT_EQ(engine->num_models(), 1u);
}

// Resident bytes of this process (RSS).
double ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  double pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<double>(sysconf(_SC_PAGESIZE));
}

TEST_F(LoraTest, EightAdaptersOnOneBaseCostTheAdaptersOnly) {
  auto engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec = LoraSpec("a0", DType::kFloat32, 2, 1);
  spec.config.vocab_size = 4096;
  spec.config.hidden_size = 256;
  spec.config.intermediate_size = 512;
  spec.config.num_hidden_layers = 4;
  const double before = ResidentBytes();
  const ModelSummary first = engine->CreateModel(spec).value();
  const double base_bytes = 4.0 * first.num_parameters;
  const double with_one = ResidentBytes();
  // The first adapter brought its base.
  EXPECT_GT(with_one - before, 0.8 * base_bytes);
  for (int i = 1; i < 8; ++i) {
    spec.model_id = "a" + std::to_string(i);
    spec.lora.seed = i;
    ASSERT_TRUE(engine->CreateModel(spec).ok());
  }
  const double growth = ResidentBytes() - with_one;
  // Seven more adapters (parameters, and the optimizer state admission
  // counts for them), with 4 MiB for the allocator's slack: far below even
  // one more base.
  const double adapters =
      7.0 * AdapterResidentBytes(first.config, first.lora, first.dtype,
                                 first.optimizer, /*dp_shard=*/1);
  EXPECT_GE(adapters, 7.0 * first.trainable_bytes);
  EXPECT_LT(growth, adapters + 4.0 * (1 << 20))
      << "base " << base_bytes << " adapter " << first.trainable_bytes;
  EXPECT_LT(growth, 0.5 * base_bytes);
}

}  // namespace
}  // namespace tally
