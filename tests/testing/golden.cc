#include "tests/testing/golden.h"

#include <gtest/gtest.h>

#include "base/status.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally::testing {

absl::StatusOr<std::unique_ptr<Engine>> CreateRankEngine(
    const MeshShape& shape, const RankEnv& env, const EngineOptions& options) {
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
  EngineOptions rank_options = options;
  // A CUDA mesh: each rank on its own GPU, as the server places them.
  if (options.device.is_cuda()) {
    rank_options.device = torch::Device(torch::kCUDA, env.local_rank);
  }
  TALLY_ASSIGN_OR_RETURN(
      auto groups,
      ProcessGroups::Create(env, mesh, absl::Seconds(60),
                            kDefaultCollectiveTimeout, rank_options.device));
  return Engine::Create(rank_options, mesh, std::move(groups));
}

void RunGoldenOnRanks(const MeshShape& shape, const EngineOptions& options,
                      const EngineOptions& reference_options,
                      const GoldenBody& body) {
  RunOnRanks(shape.world_size(), [&](const RankEnv& env) -> absl::Status {
    TALLY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                           CreateRankEngine(shape, env, options));
    TALLY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> reference,
                           Engine::CreateSingleRank(reference_options));
    return body(*engine, *reference, env);
  });
}

void ExpectSameCall(const ForwardBackwardResult& got,
                    const ForwardBackwardResult& want, double tolerance) {
  EXPECT_GT(want.valid_tokens, 0);
  EXPECT_LT(RelativeDiff(got.loss_sum, want.loss_sum), tolerance);
  EXPECT_LT(RelativeDiff(got.loss_mean, want.loss_mean), tolerance);
  EXPECT_EQ(got.valid_tokens, want.valid_tokens);
  EXPECT_EQ(got.num_samples, want.num_samples);
  EXPECT_EQ(got.window.tokens, want.window.tokens);
  EXPECT_EQ(got.window.samples, want.window.samples);
  ASSERT_EQ(got.samples.size(), want.samples.size());
  for (size_t i = 0; i < got.samples.size(); ++i) {
    const SampleResult& g = got.samples[i];
    const SampleResult& r = want.samples[i];
    EXPECT_EQ(g.valid_tokens, r.valid_tokens) << "sample " << i;
    // (+1e-300: a sample without valid tokens sums to 0 on both.)
    EXPECT_LT(RelativeDiff(g.loss_sum, r.loss_sum), tolerance + 1e-300)
        << "sample " << i;
    ASSERT_EQ(g.logprobs.size(), r.logprobs.size()) << "sample " << i;
    for (size_t t = 0; t < g.logprobs.size(); ++t) {
      EXPECT_NEAR(g.logprobs[t], r.logprobs[t], tolerance * 10)
          << "sample " << i << " token " << t;
    }
  }
}

void ExpectGradientShards(CausalLm& model, CausalLm& reference,
                          double tolerance) {
  for (const Parameter& p : model.parameters()) {
    const Parameter* ref = reference.Find(p.name);
    if (ref == nullptr) {
      ADD_FAILURE() << p.name << " missing from the reference";
      continue;
    }
    if (!p.trainable) {
      EXPECT_FALSE(p.tensor.grad().defined()) << p.name;
      EXPECT_FALSE(ref->tensor.grad().defined()) << p.name;
      continue;
    }
    if (!p.tensor.grad().defined() || !ref->tensor.grad().defined()) {
      ADD_FAILURE() << p.name << " has no gradient";
      continue;
    }
    EXPECT_TRUE(p.tensor.grad().isfinite().all().item<bool>()) << p.name;
    EXPECT_LT(
        RelativeDiff(p.tensor.grad(), model.LocalShard(p, ref->tensor.grad())),
        tolerance)
        << p.name;
  }
}

void ExpectSameStep(const OptimStepResult& got, const OptimStepResult& want,
                    const OptimStepArgs& args, double tolerance) {
  EXPECT_FALSE(got.skipped) << got.skip_reason;
  EXPECT_FALSE(want.skipped) << want.skip_reason;
  EXPECT_EQ(got.step, want.step);
  EXPECT_GT(want.grad_norm, 0);
  EXPECT_LT(RelativeDiff(got.grad_norm, want.grad_norm), tolerance);
  EXPECT_LT(RelativeDiff(got.clip_coef, want.clip_coef), tolerance);
  EXPECT_EQ(got.normalizer, want.normalizer);
  if (args.max_grad_norm.value_or(0) > 0) {
    EXPECT_LT(got.clip_coef, 1.0);
  } else {
    EXPECT_EQ(got.clip_coef, 1.0);
  }
}

}  // namespace tally::testing
