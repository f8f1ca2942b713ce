// Engine::Sample and Engine::ComputeLogprobs: the decoder's tokens through
// the engine, log-probabilities equal to ForwardBackward's of the same
// sequences, a pending window left exactly as it was, refusals by field, and
// the EOS tokens of an init_checkpoint as the default stop.
#include "runtime/engine/sample_call.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "runtime/engine/engine.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::AllEqual;
using testing::MakeSamples;
using testing::ParameterValues;
using testing::RelativeDiff;
using testing::TinySpec;

constexpr int64_t kVocab = 48;
const TokenIds kPrompt = {3, 17, 5, 40};

SampleArgs Args(std::vector<TokenIds> prompts, int64_t num_samples,
                double temperature, uint64_t seed) {
  SampleArgs args;
  args.prompts = std::move(prompts);
  args.num_samples = num_samples;
  args.max_tokens = 6;
  args.sampling.temperature = temperature;
  args.seed = seed;
  args.stop = StopConditions();  // only max_tokens ends a sequence
  return args;
}

// ForwardBackward's (forward_only, return_logprobs) log-probability of each
// token of `sequence` after the first.
std::vector<double> TrainingLogprobs(Engine& engine, const TokenIds& sequence) {
  Sample sample;
  sample.input_tokens.assign(sequence.begin(), sequence.end() - 1);
  sample.target_tokens.assign(sequence.begin() + 1, sequence.end());
  ForwardBackwardArgs args;
  args.samples = {sample};
  args.forward_only = true;
  args.return_logprobs = true;
  absl::StatusOr<ForwardBackwardResult> result =
      engine.ForwardBackward("m", args);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? result->samples[0].logprobs : std::vector<double>();
}

class SampleCallTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = Engine::CreateSingleRank({}).value();
    ASSERT_TRUE(
        engine_
            ->CreateModel(TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW))
            .ok());
  }
  CausalLm& model() { return *EngineTestPeer::Model(*engine_, "m").value(); }

  std::unique_ptr<Engine> engine_;
};

TEST_F(SampleCallTest, GreedyTokensAreTheDecodersPerSample) {
  const absl::StatusOr<SampleCallResult> sampled =
      engine_->Sample("m", Args({kPrompt, {9}}, 2, 0.0, 1));
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  DecodeRequest request;
  request.prompts = {kPrompt, kPrompt, {9}, {9}};  // prompt-major
  request.max_tokens = 6;
  request.sampling.temperature = 0;
  request.seed = 1;
  const absl::StatusOr<std::vector<DecodedSequence>> decoded =
      Decode(model(), request);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ASSERT_EQ(sampled->sequences.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(sampled->sequences[i].tokens, (*decoded)[i].tokens) << i;
    EXPECT_EQ(sampled->sequences[i].logprobs, (*decoded)[i].logprobs) << i;
    EXPECT_EQ(sampled->sequences[i].stop_reason, StopReason::kLength);
    EXPECT_EQ(sampled->sequences[i].tokens.size(), 6u);
  }
  EXPECT_EQ(sampled->seed, 1u);
  EXPECT_EQ(sampled->step, 0);
}

TEST_F(SampleCallTest, SampledLogprobsAreTheTrainingForwardsInFloat64) {
  const absl::StatusOr<SampleCallResult> sampled =
      engine_->Sample("m", Args({kPrompt}, 3, 1.0, 42));
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  bool samples_differ = false;
  for (const DecodedSequence& sequence : sampled->sequences) {
    samples_differ |= sequence.tokens != sampled->sequences[0].tokens;
    TokenIds completed = kPrompt;
    completed.insert(completed.end(), sequence.tokens.begin(),
                     sequence.tokens.end());
    const std::vector<double> training = TrainingLogprobs(*engine_, completed);
    ASSERT_EQ(training.size(), completed.size() - 1);
    for (size_t t = 0; t < sequence.tokens.size(); ++t) {
      EXPECT_LT(
          RelativeDiff(sequence.logprobs[t], training[kPrompt.size() - 1 + t]),
          1e-10)
          << "token " << t;
    }
  }
  EXPECT_TRUE(samples_differ) << "three samples at temperature 1 agreed";
}

TEST_F(SampleCallTest, PromptLogprobsAreTheTrainingForwardsInFloat64) {
  SampleArgs args = Args({kPrompt}, 1, 0.0, 1);
  args.include_prompt_logprobs = true;
  args.topk_prompt_logprobs = 3;
  const absl::StatusOr<SampleCallResult> sampled = engine_->Sample("m", args);
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  // The prompt, and the prompt followed by its greedy first token.
  const int64_t greedy = sampled->sequences[0].tokens[0];
  TokenIds extended = kPrompt;
  extended.push_back(greedy);
  LogprobsArgs logprobs;
  logprobs.prompts = {kPrompt, extended};
  logprobs.topk = 3;
  const absl::StatusOr<LogprobsCallResult> computed =
      engine_->ComputeLogprobs("m", logprobs);
  ASSERT_TRUE(computed.ok()) << computed.status();
  ASSERT_EQ(sampled->prompt_logprobs.size(), 1u);
  ASSERT_EQ(computed->prompts.size(), 2u);
  const PromptLogprobs& prompt = computed->prompts[0];
  EXPECT_EQ(sampled->prompt_logprobs[0].logprobs, prompt.logprobs);

  const std::vector<double> training = TrainingLogprobs(*engine_, kPrompt);
  ASSERT_EQ(prompt.logprobs.size(), kPrompt.size() - 1);
  ASSERT_EQ(prompt.topk.size(), kPrompt.size() - 1);
  for (size_t i = 0; i < prompt.logprobs.size(); ++i) {
    EXPECT_LT(RelativeDiff(prompt.logprobs[i], training[i]), 1e-10) << i;
    const TopkLogprobs& topk = prompt.topk[i];
    ASSERT_EQ(topk.tokens.size(), 3u);
    EXPECT_GE(topk.logprobs[0], topk.logprobs[1]);
    EXPECT_GE(topk.logprobs[1], topk.logprobs[2]);
    // The prompt's own token is at most as probable as the most probable.
    EXPECT_LE(prompt.logprobs[i], topk.logprobs[0]);
  }
  // After the whole prompt: the greedy token is the most probable, with the
  // log-probability the sampler returned for it.
  const PromptLogprobs& after = computed->prompts[1];
  ASSERT_EQ(after.topk.size(), kPrompt.size());
  EXPECT_EQ(after.topk.back().tokens[0], greedy);
  EXPECT_LT(
      RelativeDiff(after.logprobs.back(), sampled->sequences[0].logprobs[0]),
      1e-10);
}

// A sample between two ForwardBackward calls of a window sees the weights
// of the last step, and the window steps exactly as without it.
TEST_F(SampleCallTest, AWindowIsNeitherVisibleToNorChangedByASample) {
  auto other = Engine::CreateSingleRank({}).value();
  ASSERT_TRUE(
      other->CreateModel(TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW))
          .ok());
  const SampleArgs args = Args({kPrompt}, 2, 1.0, 7);
  const absl::StatusOr<SampleCallResult> before = engine_->Sample("m", args);
  ASSERT_TRUE(before.ok()) << before.status();

  const ForwardBackwardArgs first{MakeSamples(kVocab, {5, 9}, 1)};
  const ForwardBackwardArgs second{MakeSamples(kVocab, {7}, 2)};
  ASSERT_TRUE(engine_->ForwardBackward("m", first).ok());
  const absl::StatusOr<SampleCallResult> during = engine_->Sample("m", args);
  ASSERT_TRUE(during.ok()) << during.status();
  ASSERT_TRUE(engine_->ForwardBackward("m", second).ok());
  const absl::StatusOr<OptimStepResult> stepped = engine_->OptimStep("m", {});
  ASSERT_TRUE(stepped.ok()) << stepped.status();

  ASSERT_TRUE(other->ForwardBackward("m", first).ok());
  ASSERT_TRUE(other->ForwardBackward("m", second).ok());
  const absl::StatusOr<OptimStepResult> alone = other->OptimStep("m", {});
  ASSERT_TRUE(alone.ok()) << alone.status();

  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(during->sequences[i].tokens, before->sequences[i].tokens);
    EXPECT_EQ(during->sequences[i].logprobs, before->sequences[i].logprobs);
  }
  EXPECT_EQ(stepped->grad_norm, alone->grad_norm);
  EXPECT_TRUE(
      AllEqual(ParameterValues(model()),
               ParameterValues(*EngineTestPeer::Model(*other, "m").value())));
  const absl::StatusOr<SampleCallResult> after = engine_->Sample("m", args);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->step, 1);
  EXPECT_NE(after->sequences[0].logprobs, before->sequences[0].logprobs);
}

TEST_F(SampleCallTest, AnAbsentSeedIsDrawnAndReturned) {
  SampleArgs args = Args({kPrompt}, 2, 1.0, 0);
  args.seed.reset();
  const absl::StatusOr<SampleCallResult> drawn = engine_->Sample("m", args);
  ASSERT_TRUE(drawn.ok()) << drawn.status();
  args.seed = drawn->seed;
  const absl::StatusOr<SampleCallResult> again = engine_->Sample("m", args);
  ASSERT_TRUE(again.ok()) << again.status();
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(again->sequences[i].tokens, drawn->sequences[i].tokens);
  }
}

TEST_F(SampleCallTest, TokensOutsideTheVocabularyAreRefusedByField) {
  struct Case {
    SampleArgs args;
    const char* field;
  };
  std::vector<Case> cases;
  cases.push_back(
      {Args({kPrompt, {1, kVocab}}, 1, 0.0, 1), "prompts[1].tokens[1] = 48"});
  cases.push_back({Args({kPrompt}, 1, 0.0, 1), "params.stop.token_ids[0]"});
  cases.back().args.stop->token_ids = {kVocab};
  cases.push_back(
      {Args({kPrompt}, 1, 0.0, 1), "params.stop.sequences[0].tokens[1]"});
  cases.back().args.stop->sequences = {{1, kVocab + 3}};
  cases.push_back({Args({kPrompt}, 1, 0.0, 1), "topk_prompt_logprobs"});
  cases.back().args.topk_prompt_logprobs = kVocab + 1;
  for (const Case& c : cases) {
    const absl::Status status = engine_->Sample("m", c.args).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), c.field)) << status;
  }
  LogprobsArgs logprobs;
  logprobs.prompts = {{kVocab}};
  const absl::Status status = engine_->ComputeLogprobs("m", logprobs).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "prompts[0].tokens[0]"))
      << status;
}

// The EOS tokens of an init_checkpoint's generation_config.json are kept
// with the model and end a Sample without stop conditions of its own.
TEST_F(SampleCallTest, TheInitCheckpointsEosTokensStopASample) {
  const absl::StatusOr<SampleCallResult> greedy =
      engine_->Sample("m", Args({kPrompt}, 1, 0.0, 1));
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  const int64_t second = greedy->sequences[0].tokens[1];

  std::string dir =
      (std::filesystem::path(::testing::TempDir()) / "eos_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  ASSERT_TRUE(engine_->ExportWeights("m", dir + "/hf").ok());
  std::ofstream(dir + "/hf/generation_config.json")
      << "{\"eos_token_id\": [" << kVocab + 5 << ", " << second << "]}";
  ModelSpec spec = TinySpec("eos", DType::kFloat64, OptimizerKind::kAdamW);
  spec.config = LlamaConfig();
  spec.init_checkpoint = dir + "/hf";
  const absl::StatusOr<ModelSummary> created = engine_->CreateModel(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->eos_token_ids, (std::vector<int64_t>{kVocab + 5, second}));

  SampleArgs args = Args({kPrompt}, 1, 0.0, 1);
  args.stop.reset();
  const absl::StatusOr<SampleCallResult> stopped = engine_->Sample("eos", args);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  const DecodedSequence& sequence = stopped->sequences[0];
  EXPECT_EQ(sequence.stop_reason, StopReason::kStop);
  // The first occurrence of the EOS token ends it, the token included.
  const auto& full = greedy->sequences[0].tokens;
  const size_t end = std::find(full.begin(), full.end(), second) - full.begin();
  EXPECT_EQ(sequence.tokens, TokenIds(full.begin(), full.begin() + end + 1));
  std::filesystem::remove_all(dir);
}

TEST(SamplingMeshTest, OnlyASingleRankMeshSamples) {
  EXPECT_TRUE(CheckSamplingMesh(Mesh::SingleRank(), "Sample").ok());
  MeshShape shape;
  shape.tp = 2;
  const absl::Status refused =
      CheckSamplingMesh(Mesh::Create(shape, 0).value(), "Sample");
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnimplemented) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "tp=2")) << refused;
}

}  // namespace
}  // namespace tally
