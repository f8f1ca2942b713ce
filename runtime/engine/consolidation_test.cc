// Consolidation and RankPhases on one rank. The gathers of a split model
// need several ranks: the multi-rank goldens save and export through them
// (tests/golden: zero_test.cc, the pipeline and tensor-parallel checkpoint
// goldens, rank_failure_test.cc's gather failures).
#include "runtime/engine/consolidation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/model/llama_model.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/phase_boundary.h"
#include "runtime/parallel/rank_phases.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

class ConsolidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Communicator>> world =
        MakeSingleRankCommunicator(torch::kCPU);
    ASSERT_TRUE(world.ok()) << world.status();
    world_ = *std::move(world);
    Communicator* w = world_.get();
    groups_ = {w, w, w, w, w, w, w, w, w, w, w};
    absl::StatusOr<std::unique_ptr<LlamaModel>> model =
        LlamaModel::Create(testing::TinyConfig(), DType::kFloat64, 7);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
    optimizer_ = std::make_unique<Optimizer>(OptimizerKind::kAdamW,
                                             &model_->parameters());
  }

  RankPhases phases() const { return RankPhases(nullptr, *world_); }
  Consolidation consolidation() const {
    return Consolidation(mesh_, groups_, phases());
  }
  LocalModel local() { return {*model_, *optimizer_, frozen_}; }

  const Mesh mesh_ = Mesh::SingleRank();
  std::unique_ptr<Communicator> world_;
  EngineGroups groups_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<Optimizer> optimizer_;
  const std::vector<std::string> frozen_;
};

TEST_F(ConsolidationTest, AWholeModelIsWrittenFromThisRanksOwnCopy) {
  ASSERT_FALSE(Staged(*model_, groups_));
  const CausalLm* written_model = nullptr;
  const Optimizer* written_optimizer = nullptr;
  const absl::Status status = consolidation().WriteOnRankZero(
      local(), {/*with_optimizer_state=*/true, /*trainable_only=*/false},
      [&](const CausalLm& model, const Optimizer& optimizer) {
        written_model = &model;
        written_optimizer = &optimizer;
        return absl::OkStatus();
      });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(written_model, model_.get());
  EXPECT_EQ(written_optimizer, optimizer_.get());
}

TEST_F(ConsolidationTest, TheWritersFailureIsTheAgreedOutcome) {
  const absl::Status status = consolidation().WriteOnRankZero(
      local(), {/*with_optimizer_state=*/false, /*trainable_only=*/false},
      [](const CausalLm&, const Optimizer&) {
        return absl::ResourceExhaustedError("disk full");
      });
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("disk full"));
  EXPECT_TRUE(IsAgreed(status));
}

TEST_F(ConsolidationTest, OneRanksPhasesAgreeAndFinishOnItsOwnOutcome) {
  EXPECT_TRUE(phases().CollectiveFailure().ok());
  const absl::Status agreed =
      phases().Agree(absl::InvalidArgumentError("bad field"));
  EXPECT_EQ(agreed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(agreed.message(), HasSubstr("bad field"));
  EXPECT_TRUE(IsAgreed(agreed));
  // Without process groups a phase's end leaves the outcome as it was.
  const absl::Status finished =
      phases().Finish(absl::DataLossError("torn write"));
  EXPECT_EQ(finished, absl::DataLossError("torn write"));
  EXPECT_FALSE(IsAgreed(finished));
  EXPECT_TRUE(phases().Agree(absl::OkStatus()).ok());
}

}  // namespace
}  // namespace tally
