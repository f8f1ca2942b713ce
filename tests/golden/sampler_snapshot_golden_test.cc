// Golden tests of sampler snapshots on a mesh (tp = 2 x dp_shard = 2, real
// rank processes on loopback): each rank freezes its own shard (under ZeRO
// stage 3 the shard alone, under stage 1 its gathered copy too; a LoRA
// model its adapter alone), and after two more OptimSteps sampling the
// snapshot returns exactly what sampling the live weights returned at the
// step it froze — the same tokens, the same log-probabilities bitwise —
// and equals the single-device engine at that step (log-probabilities within
// 1e-10 relative), while the live weights have moved on.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/engine/engine.h"
#include "tests/testing/golden.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::MakeSamples;
using testing::RelativeDiff;

struct SnapshotMesh {
  const char* name;
  ZeroStage zero_stage;
  bool lora = false;
};

void PrintTo(const SnapshotMesh& mesh, std::ostream* os) { *os << mesh.name; }

std::string MeshName(const ::testing::TestParamInfo<SnapshotMesh>& info) {
  return info.param.name;
}

// Seeded sampling of two prompts, two sequences each, no stop token (every
// sequence runs to max_tokens), with the prompts' log-probabilities.
SampleArgs SeededSample() {
  SampleArgs args;
  args.prompts = {{3, 17, 9, 40, 1}, {22, 5}};
  args.num_samples = 2;
  args.max_tokens = 6;
  args.sampling.temperature = 0.9;
  args.seed = 1234;
  args.stop = StopConditions();
  args.include_prompt_logprobs = true;
  return args;
}

// One window of two calls and its OptimStep, the same on every engine.
absl::Status Step(Engine& engine, uint64_t seed) {
  const int64_t vocab = testing::TinyConfig().vocab_size;
  TALLY_RETURN_IF_ERROR(
      engine.ForwardBackward("m", {MakeSamples(vocab, {5, 9}, seed)}).status());
  TALLY_RETURN_IF_ERROR(
      engine.ForwardBackward("m", {MakeSamples(vocab, {3}, seed + 1)})
          .status());
  return engine.OptimStep("m", {}).status();
}

// The same tokens; log-probabilities bitwise equal (`tolerance` 0) or within
// `tolerance` relative.
void ExpectSameSample(const SampleCallResult& got, const SampleCallResult& want,
                      double tolerance, const std::string& what) {
  ASSERT_EQ(got.sequences.size(), want.sequences.size()) << what;
  for (size_t i = 0; i < want.sequences.size(); ++i) {
    const std::string where = absl::StrCat(what, ", sequence ", i);
    EXPECT_EQ(got.sequences[i].tokens, want.sequences[i].tokens) << where;
    ASSERT_EQ(got.sequences[i].logprobs.size(),
              want.sequences[i].logprobs.size())
        << where;
    for (size_t t = 0; t < want.sequences[i].logprobs.size(); ++t) {
      EXPECT_LE(RelativeDiff(got.sequences[i].logprobs[t],
                             want.sequences[i].logprobs[t]),
                tolerance)
          << where << ", token " << t;
    }
  }
  ASSERT_EQ(got.prompt_logprobs.size(), want.prompt_logprobs.size()) << what;
  for (size_t i = 0; i < want.prompt_logprobs.size(); ++i) {
    const std::vector<double>& got_lp = got.prompt_logprobs[i].logprobs;
    const std::vector<double>& want_lp = want.prompt_logprobs[i].logprobs;
    ASSERT_EQ(got_lp.size(), want_lp.size()) << what;
    for (size_t t = 0; t < want_lp.size(); ++t) {
      EXPECT_LE(RelativeDiff(got_lp[t], want_lp[t]), tolerance)
          << what << ", prompt " << i << ", position " << t;
    }
  }
}

class SamplerSnapshotGoldenTest
    : public ::testing::TestWithParam<SnapshotMesh> {};

TEST_P(SamplerSnapshotGoldenTest, SamplesAsTheLiveWeightsAtItsStep) {
  const SnapshotMesh& mesh = GetParam();
  EngineOptions options;
  options.zero_stage = mesh.zero_stage;
  ModelSpec spec =
      testing::TinySpec("m", DType::kFloat64, OptimizerKind::kAdamW);
  if (mesh.lora) spec.lora = testing::TestLora();
  testing::RunGoldenOnRanks(
      testing::Shape(1, 2, 2), options, options,
      [&](Engine& engine, Engine& reference,
          const RankEnv& env) -> absl::Status {
        const std::string where = absl::StrCat("rank ", env.rank);
        for (Engine* e : {&engine, &reference}) {
          TALLY_RETURN_IF_ERROR(e->CreateModel(spec).status());
          TALLY_RETURN_IF_ERROR(Step(*e, 1));
        }
        TALLY_ASSIGN_OR_RETURN(const SampleCallResult live,
                               engine.Sample("m", SeededSample()));
        TALLY_ASSIGN_OR_RETURN(const SampleCallResult single,
                               reference.Sample("m", SeededSample()));
        TALLY_ASSIGN_OR_RETURN(const SamplerSummary saved,
                               engine.SaveWeightsForSampler("m", "step1"));
        EXPECT_EQ(saved.step, 1) << where;
        EXPECT_EQ(saved.is_adapter, mesh.lora) << where;
        EXPECT_GT(saved.bytes, 0u) << where;
        TALLY_RETURN_IF_ERROR(Step(engine, 5));
        TALLY_RETURN_IF_ERROR(Step(engine, 9));

        TALLY_ASSIGN_OR_RETURN(const SampleCallResult frozen,
                               engine.Sample("m", SeededSample(), "step1"));
        EXPECT_EQ(frozen.step, 1) << where;
        ExpectSameSample(frozen, live, /*tolerance=*/0,
                         absl::StrCat(where, ", snapshot vs live"));
        ExpectSameSample(frozen, single, /*tolerance=*/1e-10,
                         absl::StrCat(where, ", snapshot vs single rank"));
        TALLY_ASSIGN_OR_RETURN(const SampleCallResult now,
                               engine.Sample("m", SeededSample()));
        EXPECT_EQ(now.step, 3) << where;
        EXPECT_NE(now.prompt_logprobs[0].logprobs,
                  live.prompt_logprobs[0].logprobs)
            << where << ": the live weights did not move";
        return absl::OkStatus();
      });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, SamplerSnapshotGoldenTest,
    ::testing::Values(
        SnapshotMesh{"tp2_dp_shard2_zero3", ZeroStage::kParameters},
        SnapshotMesh{"tp2_dp_shard2_zero1", ZeroStage::kOptimizerState},
        SnapshotMesh{"tp2_dp_shard2_lora", ZeroStage::kParameters,
                     /*lora=*/true}),
    MeshName);

}  // namespace
}  // namespace tally
