// What SaveCheckpoint and LoadCheckpoint do to a live model: the dirty-window
// policy, all-or-nothing loads of damaged checkpoints, and the server state
// carried through the command layer.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"
#include "server/commands.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

using testing::AllEqual;
using testing::MakeSamples;
using testing::ParameterValues;
using testing::TinySpec;

constexpr int64_t kVocab = 48;

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class CheckpointPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::path(::testing::TempDir()) / "checkpoint_policy_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
    engine_ = Engine::CreateSingleRank({}).value();
    ASSERT_TRUE(
        engine_
            ->CreateModel(TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW))
            .ok());
    // One applied step, so weights and moments differ from initialization.
    ASSERT_TRUE(Train({4, 3}, 1).ok());
    ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
  }
  void TearDown() override { fs::remove_all(root_); }

  absl::Status Train(const std::vector<int>& valid, uint64_t seed) {
    return engine_->ForwardBackward("m", {MakeSamples(kVocab, valid, seed)})
        .status();
  }
  CausalLm& model() { return *EngineTestPeer::Model(*engine_, "m").value(); }
  std::string PathOf(const std::string& name) const {
    return (fs::path(root_) / name).string();
  }

  std::string root_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(CheckpointPolicyTest, PendingWindowRefusesToSaveByDefault) {
  ASSERT_TRUE(Train({5, 2}, 2).ok());
  const std::string dir = PathOf("dirty");
  const absl::Status refused = engine_->SaveCheckpoint("m", dir).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(std::string(refused.message()).find("allow_pending"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 1);  // window kept
}

TEST_F(CheckpointPolicyTest, AllowPendingSavesWithoutTheWindow) {
  const auto weights = ParameterValues(model());
  ASSERT_TRUE(Train({5, 2}, 2).ok());
  const std::string dir = PathOf("dirty");
  SaveOptions options;
  options.allow_pending = true;
  absl::StatusOr<SaveResult> saved = engine_->SaveCheckpoint("m", dir, options);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->unsaved_window.calls, 1);
  EXPECT_EQ(saved->unsaved_window.tokens, 7);
  EXPECT_EQ(saved->unsaved_window.samples, 2);
  const nlohmann::json manifest =
      nlohmann::json::parse(ReadText(dir + "/tally.json"));
  EXPECT_EQ(manifest["unsaved_window"]["calls"], 1);
  EXPECT_EQ(manifest["unsaved_window"]["tokens"], 7);
  // The live model keeps its window; the checkpoint has none.
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 1);
  absl::StatusOr<LoadResult> loaded =
      engine_->LoadCheckpoint("m", dir, /*load_optimizer=*/true);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->model.window.calls, 0);
  EXPECT_EQ(loaded->model.step, 1);
  EXPECT_TRUE(AllEqual(weights, ParameterValues(model())));
}

TEST_F(CheckpointPolicyTest, DamagedCheckpointLoadChangesNothing) {
  const std::string dir = PathOf("ckpt");
  ASSERT_TRUE(engine_->SaveCheckpoint("m", dir).ok());
  const auto saved = ParameterValues(model());
  ASSERT_TRUE(Train({6}, 3).ok());
  ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
  ASSERT_TRUE(Train({2}, 4).ok());  // a pending window, kept on failure
  const auto weights = ParameterValues(model());
  ASSERT_FALSE(AllEqual(weights, saved));  // a load would show

  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string path = dir + "/" + file;
    const std::string original = ReadText(path);
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        << original.substr(0, original.size() / 2);
    const absl::Status status =
        engine_->LoadCheckpoint("m", dir, /*load_optimizer=*/true).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_NE(std::string(status.message()).find(path), std::string::npos);
    EXPECT_TRUE(AllEqual(weights, ParameterValues(model())));
    EXPECT_EQ(engine_->GetModel("m")->step, 2);
    EXPECT_EQ(engine_->GetModel("m")->window.calls, 1);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << original;
  }
  EXPECT_TRUE(engine_->LoadCheckpoint("m", dir, true).ok());
  EXPECT_EQ(engine_->GetModel("m")->step, 1);
  EXPECT_TRUE(AllEqual(saved, ParameterValues(model())));
}

// The proto plumbing: allow_pending in, unsaved_* out, and the server's
// opaque state back on load.
TEST_F(CheckpointPolicyTest, CommandsCarryAllowPendingAndServerState) {
  ASSERT_TRUE(Train({3}, 5).ok());
  v1::SaveCheckpointRequest save;
  save.set_model_id("m");
  save.set_path(PathOf("cmd"));
  v1::SaveCheckpointResponse saved;
  EXPECT_EQ(ExecuteSaveCheckpoint(*engine_, save, &saved, "state").code(),
            absl::StatusCode::kFailedPrecondition);
  save.set_allow_pending(true);
  const std::string server_state("seq\0cache", 9);
  ASSERT_TRUE(ExecuteSaveCheckpoint(*engine_, save, &saved, server_state).ok());
  EXPECT_EQ(saved.unsaved_calls(), 1);
  EXPECT_EQ(saved.unsaved_tokens(), 3);
  EXPECT_EQ(saved.unsaved_samples(), 1);
  EXPECT_EQ(saved.step(), 1);

  v1::LoadCheckpointRequest load;
  load.set_model_id("m");
  load.set_path(PathOf("cmd"));
  load.set_load_optimizer(true);
  v1::LoadCheckpointResponse loaded;
  LoadResult restored;
  ASSERT_TRUE(ExecuteLoadCheckpoint(*engine_, load, &loaded, &restored).ok());
  EXPECT_EQ(restored.server_state, server_state);
  // The window the save dropped, which a load continuing its seq_ids poisons.
  EXPECT_EQ(restored.unsaved_window.calls, saved.unsaved_calls());
  EXPECT_EQ(restored.unsaved_window.tokens, saved.unsaved_tokens());
  EXPECT_EQ(loaded.discarded_calls(), 1);
}

}  // namespace
}  // namespace tally
