// The gradient norm and clipping of OptimStep, on a single rank (the
// multi-rank golden tests reuse the same code with larger meshes).
#include "runtime/parallel/grad_norm.h"

#include <gtest/gtest.h>

#include <cmath>

#include "runtime/model/llama_model.h"
#include "runtime/parallel/communicator.h"
#include "runtime/train/accumulation.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::RelativeDiff;
using testing::TinyConfig;

class GradNormTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    world_ = MakeSingleRankCommunicator().value();
    model_ = LlamaModel::Create(TinyConfig(), GetParam(), 3).value();
  }
  // Sets every gradient from `fill(param index, param tensor)`.
  template <typename Fn>
  void SetGrads(Fn fill) {
    for (size_t i = 0; i < params().size(); ++i) {
      params()[i].tensor.mutable_grad() = fill(i, params()[i].tensor.detach());
    }
  }
  std::vector<Parameter>& params() { return model_->parameters(); }
  torch::Tensor Concatenated() {
    std::vector<torch::Tensor> flat;
    for (auto& p : params()) flat.push_back(p.tensor.grad().flatten());
    return torch::cat(flat);
  }

  std::unique_ptr<Communicator> world_;
  std::unique_ptr<LlamaModel> model_;
  Mesh mesh_ = Mesh::SingleRank();
};

TEST_P(GradNormTest, AllOnesOracleIsSqrtOfNumel) {
  SetGrads([](size_t, const torch::Tensor& p) { return torch::ones_like(p); });
  GradNorm norm =
      ComputeGlobalGradNorm(params(), mesh_, *world_, NormType::kL2).value();
  const double numel = static_cast<double>(TinyConfig().NumParameters());
  EXPECT_EQ(model_->NumParameters(), TinyConfig().NumParameters());
  EXPECT_LT(RelativeDiff(norm.total, std::sqrt(numel)), 1e-14);
  EXPECT_EQ(norm.expert, 0.0);

  // Clipping to half the norm: every gradient becomes max/(norm + 1e-6).
  const double max_norm = norm.total / 2;
  ClipResult clip =
      NormalizeAndClip(params(), 1.0, mesh_, *world_, NormType::kL2, max_norm)
          .value();
  const double expected = max_norm / (norm.total + 1e-6);
  EXPECT_LT(RelativeDiff(clip.clip_coef, expected), 1e-14);
  for (auto& p : params()) {
    EXPECT_LT(
        RelativeDiff(p.tensor.grad(), torch::full_like(p.tensor, expected)),
        GetParam() == DType::kFloat64 ? 1e-15 : 1e-7);
  }
}

TEST_P(GradNormTest, L2AndInfMatchTorchOnTheConcatenation) {
  SetGrads([](size_t i, const torch::Tensor& p) {
    return torch::randn_like(p) * static_cast<double>(i + 1);
  });
  const torch::Tensor all = Concatenated().to(torch::kFloat64);
  const double l2 =
      torch::linalg_vector_norm(all, 2, {}, false, {}).item<double>();
  const double inf =
      torch::linalg_vector_norm(all, INFINITY, {}, false, {}).item<double>();
  GradNorm got_l2 =
      ComputeGlobalGradNorm(params(), mesh_, *world_, NormType::kL2).value();
  GradNorm got_inf =
      ComputeGlobalGradNorm(params(), mesh_, *world_, NormType::kInf).value();
  EXPECT_LT(RelativeDiff(got_l2.total, l2), 1e-12);
  EXPECT_EQ(got_inf.total, inf);
  EXPECT_GT(l2, inf);  // the two norms really differ
}

TEST_P(GradNormTest, HugeGradientsStayFiniteWithFp64Squares) {
  // (1e20)^2 overflows fp32; the fp64 accumulation must not.
  SetGrads(
      [](size_t, const torch::Tensor& p) { return torch::full_like(p, 1e20); });
  GradNorm norm =
      ComputeGlobalGradNorm(params(), mesh_, *world_, NormType::kL2).value();
  const double numel = static_cast<double>(model_->NumParameters());
  ASSERT_TRUE(std::isfinite(norm.total));
  EXPECT_LT(RelativeDiff(norm.total, 1e20 * std::sqrt(numel)), 1e-6);
}

TEST_P(GradNormTest, ZeroGradientsGiveZeroAndNoClipping) {
  SetGrads([](size_t, const torch::Tensor& p) { return torch::zeros_like(p); });
  ClipResult clip =
      NormalizeAndClip(params(), 7.0, mesh_, *world_, NormType::kL2, 1.0)
          .value();
  EXPECT_EQ(clip.norm.total, 0.0);
  EXPECT_EQ(clip.clip_coef, 1.0);
}

TEST_P(GradNormTest, NormBelowMaxLeavesNormalizedGradientsUnclipped) {
  SetGrads([](size_t, const torch::Tensor& p) { return torch::randn_like(p); });
  std::vector<torch::Tensor> raw = testing::Gradients(*model_);
  const double normalizer = 13.0;
  ClipResult clip =
      NormalizeAndClip(params(), normalizer, mesh_, *world_, NormType::kL2, 1e9)
          .value();
  EXPECT_EQ(clip.clip_coef, 1.0);
  for (size_t i = 0; i < raw.size(); ++i) {
    // One rounding of g * (1/N) against g / N: a few ulps.
    EXPECT_LT(RelativeDiff(params()[i].tensor.grad(), raw[i] / normalizer),
              GetParam() == DType::kFloat64 ? 1e-15 : 5e-7);
  }
}

TEST_P(GradNormTest, ClippedGradientHasExactlyMaxNorm) {
  SetGrads([](size_t, const torch::Tensor& p) { return torch::randn_like(p); });
  const double max_norm = 0.25;
  ClipResult clip =
      NormalizeAndClip(params(), 3.0, mesh_, *world_, NormType::kL2, max_norm)
          .value();
  ASSERT_LT(clip.clip_coef, 1.0);
  const double after = torch::linalg_vector_norm(
                           Concatenated().to(torch::kFloat64), 2, {}, false, {})
                           .item<double>();
  EXPECT_LT(RelativeDiff(after, max_norm), 1e-6);
}

TEST_P(GradNormTest, NonFiniteNormLeavesGradientsUntouched) {
  SetGrads([](size_t, const torch::Tensor& p) { return torch::ones_like(p); });
  params()[3].tensor.mutable_grad()[0][0] = NAN;
  std::vector<torch::Tensor> before = testing::Gradients(*model_);
  for (NormType type : {NormType::kL2, NormType::kInf}) {
    ClipResult clip =
        NormalizeAndClip(params(), 2.0, mesh_, *world_, type, 1.0).value();
    EXPECT_TRUE(std::isnan(clip.norm.total));
  }
  params()[3].tensor.mutable_grad()[0][0] = INFINITY;
  ClipResult inf_clip =
      NormalizeAndClip(params(), 2.0, mesh_, *world_, NormType::kInf, 1.0)
          .value();
  EXPECT_EQ(inf_clip.norm.total, INFINITY);
  before[3][0][0] = INFINITY;
  std::vector<torch::Tensor> after = testing::Gradients(*model_);
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i], after[i])) << i;
  }
}

TEST_P(GradNormTest, IssuesExactlyOneCollective) {
  SetGrads([](size_t, const torch::Tensor& p) { return torch::ones_like(p); });
  world_->stats().Reset();
  ASSERT_TRUE(
      ComputeGlobalGradNorm(params(), mesh_, *world_, NormType::kL2).ok());
  EXPECT_EQ(world_->stats().TotalCalls(), 1);
  EXPECT_EQ(world_->stats().Get(CommOp::kAllReduce).calls, 1);
  ASSERT_TRUE(
      ComputeGlobalGradNorm(params(), mesh_, *world_, NormType::kInf).ok());
  EXPECT_EQ(world_->stats().TotalCalls(), 2);
}

TEST(PlacementTest, ReplicasAreCountedOnceShardsEverywhere) {
  MeshShape shape;
  shape.dp_replicate = 2;
  shape.tp = 2;
  Placements replicated;
  Placements tp_sharded;
  tp_sharded.Set(MeshDim::kTp, Placement::Shard(0));
  int replicated_count = 0, sharded_count = 0;
  for (int rank = 0; rank < shape.world_size(); ++rank) {
    Mesh mesh = Mesh::Create(shape, rank).value();
    replicated_count += replicated.IsCanonicalReplica(mesh);
    sharded_count += tp_sharded.IsCanonicalReplica(mesh);
  }
  EXPECT_EQ(replicated_count, 1);  // one copy of a replicated weight
  EXPECT_EQ(sharded_count, 2);     // each of the two tp shards once
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GradNormTest,
                         ::testing::Values(DType::kFloat64, DType::kFloat32),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace tally
