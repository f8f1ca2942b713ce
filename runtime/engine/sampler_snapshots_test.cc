// Sampler snapshots on a single-rank engine: a snapshot samples bitwise as
// the live weights did when it was taken, whatever OptimSteps follow, and
// leaves the live weights as they were; a LoRA model's holds its adapter
// alone; names are unique per model and missing ones NOT_FOUND; a deleted
// snapshot's memory is freed, and DeleteModel takes its snapshots along.
#include "runtime/engine/sampler_snapshots.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"
#include "runtime/model/lora.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;
using testing::MakeSamples;
using testing::ParameterValues;
using testing::TinySpec;

constexpr int64_t kVocab = 48;

SampleArgs SeededSample() {
  SampleArgs args;
  args.prompts = {{3, 17, 9}, {22, 5}};
  args.num_samples = 2;
  args.max_tokens = 5;
  args.sampling.temperature = 0.9;
  args.seed = 77;
  args.stop = StopConditions();  // none: every sequence runs to max_tokens
  args.include_prompt_logprobs = true;
  return args;
}

// The same tokens, and log-probabilities bitwise equal.
void ExpectSameSample(const SampleCallResult& got,
                      const SampleCallResult& want) {
  ASSERT_EQ(got.sequences.size(), want.sequences.size());
  for (size_t i = 0; i < want.sequences.size(); ++i) {
    EXPECT_EQ(got.sequences[i].tokens, want.sequences[i].tokens) << i;
    EXPECT_EQ(got.sequences[i].logprobs, want.sequences[i].logprobs) << i;
  }
  ASSERT_EQ(got.prompt_logprobs.size(), want.prompt_logprobs.size());
  for (size_t i = 0; i < want.prompt_logprobs.size(); ++i) {
    EXPECT_EQ(got.prompt_logprobs[i].logprobs, want.prompt_logprobs[i].logprobs)
        << i;
  }
}

class SamplerSnapshotTest : public ::testing::Test {
 protected:
  void Create(const ModelSpec& spec) {
    engine_ = Engine::CreateSingleRank({}).value();
    ASSERT_TRUE(engine_->CreateModel(spec).ok());
  }
  void Step(uint64_t seed) {
    ASSERT_TRUE(
        engine_->ForwardBackward("m", {MakeSamples(kVocab, {4, 7}, seed)})
            .ok());
    ASSERT_TRUE(engine_->OptimStep("m", {}).ok());
  }
  CausalLm& model() { return *EngineTestPeer::Model(*engine_, "m").value(); }

  std::unique_ptr<Engine> engine_;
};

TEST_F(SamplerSnapshotTest, LaterStepsDoNotChangeASnapshot) {
  Create(TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW));
  Step(1);
  const SampleCallResult want = engine_->Sample("m", SeededSample()).value();
  const LogprobsCallResult want_logprobs =
      engine_->ComputeLogprobs("m", {{{4, 8, 15, 16}}, 3}).value();
  const absl::StatusOr<SamplerSummary> saved =
      engine_->SaveWeightsForSampler("m", "s1");
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step, 1);
  EXPECT_FALSE(saved->is_adapter);
  EXPECT_EQ(saved->bytes, engine_->GetModel("m")->trainable_bytes);
  Step(2);
  Step(3);
  // A pending window does not reach a snapshot either.
  ASSERT_TRUE(
      engine_->ForwardBackward("m", {MakeSamples(kVocab, {5}, 4)}).ok());

  const std::vector<torch::Tensor> live = ParameterValues(model());
  const absl::StatusOr<SampleCallResult> got =
      engine_->Sample("m", SeededSample(), "s1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->step, 1);
  ExpectSameSample(*got, want);
  const LogprobsCallResult got_logprobs =
      engine_->ComputeLogprobs("m", {{{4, 8, 15, 16}}, 3}, "s1").value();
  EXPECT_EQ(got_logprobs.step, 1);
  EXPECT_EQ(got_logprobs.prompts[0].logprobs,
            want_logprobs.prompts[0].logprobs);
  // The live weights are back, and they did move.
  EXPECT_TRUE(testing::AllEqual(ParameterValues(model()), live));
  const SampleCallResult now = engine_->Sample("m", SeededSample()).value();
  EXPECT_EQ(now.step, 3);
  EXPECT_NE(now.prompt_logprobs[0].logprobs, want.prompt_logprobs[0].logprobs);
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 1);
}

TEST_F(SamplerSnapshotTest, AnAdapterSnapshotCopiesTheAdapterAlone) {
  ModelSpec spec = TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW);
  spec.lora = testing::TestLora();
  Create(spec);
  Step(1);
  const SampleCallResult want = engine_->Sample("m", SeededSample()).value();
  const SamplerSummary saved =
      engine_->SaveWeightsForSampler("m", "adapter").value();
  EXPECT_TRUE(saved.is_adapter);
  uint64_t adapter_bytes = 0;
  for (const Parameter& p : model().parameters()) {
    if (IsLoraParameter(p.name)) adapter_bytes += p.tensor.nbytes();
  }
  EXPECT_GT(adapter_bytes, 0u);
  EXPECT_EQ(saved.bytes, adapter_bytes);
  EXPECT_EQ(saved.bytes, engine_->GetModel("m")->trainable_bytes);
  Step(2);
  ExpectSameSample(engine_->Sample("m", SeededSample(), "adapter").value(),
                   want);
}

TEST_F(SamplerSnapshotTest, NamesAreUniquePerModelAndMissingOnesNotFound) {
  Create(TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW));
  ASSERT_TRUE(
      engine_
          ->CreateModel(TinySpec("n", DType::kFloat32, OptimizerKind::kAdamW))
          .ok());
  ASSERT_TRUE(engine_->SaveWeightsForSampler("m", "a").ok());
  ASSERT_TRUE(engine_->SaveWeightsForSampler("n", "a").ok());
  const absl::Status repeat = engine_->SaveWeightsForSampler("m", "a").status();
  EXPECT_EQ(repeat.code(), absl::StatusCode::kAlreadyExists) << repeat;
  EXPECT_THAT(std::string(repeat.message()), HasSubstr("sampler 'a'"));
  const absl::Status bad = engine_->SaveWeightsForSampler("m", "a/b").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_THAT(std::string(bad.message()), HasSubstr("name"));

  const absl::Status missing =
      engine_->Sample("m", SeededSample(), "nope").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_THAT(std::string(missing.message()), HasSubstr("sampler 'nope'"));
  EXPECT_EQ(
      engine_->ComputeLogprobs("m", {{{1, 2}}, 0}, "nope").status().code(),
      absl::StatusCode::kNotFound);

  EXPECT_EQ(engine_->ListSamplers("").value().size(), 2u);
  ASSERT_EQ(engine_->ListSamplers("m").value().size(), 1u);
  EXPECT_EQ(engine_->ListSamplers("m").value()[0].model_id, "m");
  EXPECT_EQ(engine_->ListSamplers("x").status().code(),
            absl::StatusCode::kNotFound);

  ASSERT_TRUE(engine_->DeleteSampler("m", "a").ok());
  EXPECT_EQ(engine_->DeleteSampler("m", "a").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Sample("m", SeededSample(), "a").status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(engine_->DeleteModel("n").ok());
  EXPECT_TRUE(engine_->ListSamplers("").value().empty());
  // The name is free again.
  EXPECT_TRUE(engine_->SaveWeightsForSampler("m", "a").ok());
}

TEST_F(SamplerSnapshotTest, RemovingASnapshotFreesItsTensors) {
  Create(TinySpec("m", DType::kFloat32, OptimizerKind::kAdamW));
  SamplerSnapshots snapshots;
  snapshots.Add("s", SamplerSnapshot::Take(model(), 0).value());
  std::vector<
      c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>>
      copies;
  {
    SwappedInWeights swapped(model(), *snapshots.Find("m", "s").value());
    for (const Parameter& p : model().parameters()) {
      copies.emplace_back(p.tensor.getIntrusivePtr());
    }
  }
  ASSERT_FALSE(copies.empty());
  for (const auto& copy : copies) EXPECT_FALSE(copy.expired());
  ASSERT_TRUE(snapshots.Remove("m", "s").ok());
  for (const auto& copy : copies) EXPECT_TRUE(copy.expired());
}

}  // namespace
}  // namespace tally
