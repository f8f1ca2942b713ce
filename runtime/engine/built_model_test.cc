// BuildModel and BuiltModel (runtime/engine/built_model.h) on one rank, without
// an engine: an adapter shares the base its key names in SharedBases, the
// summary counts what trains, and a checkpoint load changes nothing until
// its second phase.
#include "runtime/engine/built_model.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <filesystem>
#include <memory>
#include <string>

#include "runtime/model/shared_bases.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/engine_groups.h"
#include "runtime/parallel/mesh.h"
#include "runtime/parallel/rank_phases.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

class BuildModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    world_ = MakeSingleRankCommunicator(torch::kCPU).value();
    groups_ = SingleRankGroups(*world_);
  }

  absl::StatusOr<std::unique_ptr<BuiltModel>> Build(
      const ModelSpec& spec, const std::string& base_key) {
    return BuildModel(spec, base_key,
                      RankContext{mesh_, groups_, RankPhases(nullptr, *world_)},
                      BuildOptions(), bases_);
  }

  static ModelSpec Spec(const std::string& id) {
    return testing::TinySpec(id, DType::kFloat64, OptimizerKind::kAdamW);
  }
  static ModelSpec AdapterSpec(const std::string& id) {
    ModelSpec spec = Spec(id);
    spec.lora = testing::TestLora();
    return spec;
  }

  const Mesh mesh_ = Mesh::SingleRank();
  std::unique_ptr<Communicator> world_;
  EngineGroups groups_;
  SharedBases bases_;
};

TEST_F(BuildModelTest, AdaptersShareTheBaseTheirKeyNames) {
  auto first = Build(AdapterSpec("a"), "key").value();
  // Not held here, so that the base lives as long as its models only.
  const CausalLm* base = first->model().base().get();
  ASSERT_NE(base, nullptr);
  EXPECT_EQ(bases_.Find("key"), nullptr) << "not shared before it is added";
  bases_.Remember("key", first->model());
  EXPECT_EQ(bases_.Find("key").get(), base);
  EXPECT_EQ(bases_.Config("key"), first->model().config());

  auto second = Build(AdapterSpec("b"), "key").value();
  EXPECT_EQ(second->model().base().get(), base);
  auto other = Build(AdapterSpec("c"), "other key").value();
  EXPECT_NE(other->model().base().get(), base);
  // A model without an adapter shares nothing.
  auto plain = Build(Spec("d"), "").value();
  EXPECT_EQ(plain->model().base(), nullptr);
  bases_.Remember("", plain->model());
  EXPECT_EQ(bases_.Find(""), nullptr);

  first.reset();
  bases_.ForgetUnshared();
  EXPECT_EQ(bases_.Find("key").get(), base)
      << "the second adapter still shares it";
  second.reset();
  bases_.ForgetUnshared();
  EXPECT_EQ(bases_.Find("key"), nullptr);
  EXPECT_FALSE(bases_.Config("key").has_value());
}

// The summary's trainable count is what the parameters that train hold
// (every parameter, or an adapter's factors only).
TEST_F(BuildModelTest, DescribeCountsTheParametersThatTrain) {
  for (const ModelSpec& spec : {Spec("plain"), AdapterSpec("adapter")}) {
    SCOPED_TRACE(spec.model_id);
    auto built = Build(spec, spec.lora.enabled() ? "key" : "").value();
    uint64_t trainable = 0;
    for (const Parameter& p : built->model().parameters()) {
      if (p.trainable) trainable += p.tensor.numel();
    }
    const ModelSummary summary = built->Describe();
    EXPECT_EQ(summary.model_id, spec.model_id);
    EXPECT_EQ(summary.trainable_parameters, trainable);
    EXPECT_EQ(summary.trainable_bytes, trainable * sizeof(double));
    EXPECT_EQ(summary.trainable_parameters == summary.num_parameters,
              !spec.lora.enabled());
  }
}

// LoadCheckpoint's first phase reads and checks without touching the model;
// the second copies the weights in and takes the staged optimizer.
TEST_F(BuildModelTest, StagedLoadChangesNothingUntilApplied) {
  std::string dir =
      (fs::path(::testing::TempDir()) / "built_model_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/ckpt";
  auto saved = Build(Spec("saved"), "").value();
  CheckpointManifest manifest;
  manifest.step = 3;
  ASSERT_TRUE(saved->SaveCheckpoint(path, manifest, {}).ok());

  ModelSpec other = Spec("loaded");
  other.seed = 99;  // other weights
  auto loaded = Build(other, "").value();
  const auto before = testing::ParameterValues(loaded->model());
  const Optimizer* optimizer = &loaded->optimizer();
  absl::StatusOr<StagedLoad> staged =
      loaded->StageLoad(path, /*load_optimizer=*/true);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_TRUE(
      testing::AllEqual(testing::ParameterValues(loaded->model()), before));
  EXPECT_EQ(&loaded->optimizer(), optimizer);
  ASSERT_EQ(staged->contents.manifest->step, 3);

  ASSERT_TRUE(loaded->ApplyLoad(*staged).ok());
  EXPECT_TRUE(testing::AllEqual(testing::ParameterValues(loaded->model()),
                                testing::ParameterValues(saved->model())));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tally
