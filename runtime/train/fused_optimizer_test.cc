// The fused OptimStep kernels (kernels/fused_optimizer.h) and their wiring
// (ComputeClip + Optimizer::Step with a gradient scale) against the composed
// LibTorch path: grad.mul_(clip_coef / normalizer), then torch::optim::AdamW
// or the SGD ops.
#include "kernels/fused_optimizer.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cuda_tensors.h"
#include "kernels/grad_stats.h"
#include "runtime/model/llama_model.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/torch_compat.h"
#include "runtime/train/accumulation.h"
#include "runtime/train/optimizer.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using kernels::UpdateHyperparameters;
using kernels::UpdateOperands;

// Shapes across the chunk size (32768 elements) and the vector widths,
// including empty and odd lengths.
const std::vector<std::vector<int64_t>> kShapes = {
    {0},    {1},         {7},       {3, 5},   {17, 0, 3},
    {1023}, {32767 + 2}, {64, 129}, {100003}, {2, 3, 4, 5}};

// Distance in representable values between two finite floats of one sign
// convention: 0 when bitwise equal, 1 for neighbours.
template <typename T, typename Bits>
int64_t UlpDistance(T a, T b) {
  Bits ia, ib;
  std::memcpy(&ia, &a, sizeof(a));
  std::memcpy(&ib, &b, sizeof(b));
  // Sign-magnitude to a monotonic integer line.
  const auto ordered = [](Bits bits) -> long double {
    constexpr Bits kSign = Bits{1} << (sizeof(Bits) * 8 - 1);
    return (bits & kSign) ? -static_cast<long double>(bits & ~kSign)
                          : static_cast<long double>(bits);
  };
  return static_cast<int64_t>(std::fabs(ordered(ia) - ordered(ib)));
}

// Largest ulp distance between two same-shaped float or double tensors; a
// NaN on either side counts as infinitely far.
int64_t MaxUlps(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  EXPECT_EQ(a.scalar_type(), b.scalar_type());
  const torch::Tensor ca = a.contiguous(), cb = b.contiguous();
  int64_t worst = 0;
  for (int64_t i = 0; i < ca.numel(); ++i) {
    int64_t ulps;
    if (ca.scalar_type() == torch::kFloat) {
      const float x = ca.data_ptr<float>()[i], y = cb.data_ptr<float>()[i];
      if (std::isnan(x) || std::isnan(y)) return INT64_MAX;
      ulps = UlpDistance<float, uint32_t>(x, y);
    } else {
      const double x = ca.data_ptr<double>()[i], y = cb.data_ptr<double>()[i];
      if (std::isnan(x) || std::isnan(y)) return INT64_MAX;
      ulps = UlpDistance<double, uint64_t>(x, y);
    }
    worst = std::max(worst, ulps);
  }
  return worst;
}

// How far parameters and moments may be from the composed path: ATen's AVX2
// and AVX512 kernels round exactly where the fused ones do (the same fmas),
// its baseline kernels may differ by an ulp per operation.
int64_t AllowedUlps() {
  const std::string config = at::show_config();
  return config.find("CPU capability usage: AVX") != std::string::npos ? 0 : 4;
}

class FusedOptimizerTest : public ::testing::TestWithParam<torch::ScalarType> {
 protected:
  torch::Tensor Random(const std::vector<int64_t>& shape) {
    return torch::randn(shape, torch::TensorOptions().dtype(GetParam()));
  }
};

// A per-step schedule with weight decay on and off, a zero learning rate and
// a gradient scale as OptimStep computes it.
std::vector<UpdateHyperparameters> Schedule() {
  std::vector<UpdateHyperparameters> steps(4);
  steps[0] = {1e-2, 0.9, 0.999, 1e-8, 0.01, 1, 0.37 / 13};
  steps[1] = {5e-3, 0.8, 0.99, 1e-6, 0.0, 2, 1.0 / 3};
  steps[2] = {2e-2, 0.95, 0.9, 1e-8, 0.3, 3, 1.0};
  steps[3] = {0.0, 0.9, 0.999, 1e-8, 0.1, 4, 0.5};
  return steps;
}

TEST_P(FusedOptimizerTest, AdamWMatchesGradMulThenTorchOptimAdamW) {
  torch::manual_seed(11);
  std::vector<UpdateOperands> fused;
  std::vector<torch::Tensor> theirs;
  for (const auto& shape : kShapes) {
    const torch::Tensor p = Random(shape);
    fused.push_back({p.clone(), torch::Tensor(), torch::zeros_like(p),
                     torch::zeros_like(p)});
    theirs.push_back(p.clone().requires_grad_());
  }
  torch::optim::AdamW reference(theirs);
  for (const UpdateHyperparameters& hp : Schedule()) {
    for (size_t i = 0; i < kShapes.size(); ++i) {
      const torch::Tensor raw = Random(kShapes[i]);
      fused[i].grad = raw.clone();
      theirs[i].mutable_grad() = raw.clone().mul_(hp.grad_scale);
    }
    auto& options = static_cast<torch::optim::AdamWOptions&>(
        reference.param_groups()[0].options());
    options.lr(hp.learning_rate)
        .betas({hp.beta1, hp.beta2})
        .eps(hp.eps)
        .weight_decay(hp.weight_decay);
    reference.step();
    const std::vector<torch::Tensor> raw_grads = [&] {
      std::vector<torch::Tensor> copies;
      for (const UpdateOperands& t : fused) copies.push_back(t.grad.clone());
      return copies;
    }();
    ASSERT_TRUE(kernels::FusedAdamW(fused, hp).ok());
    for (size_t i = 0; i < kShapes.size(); ++i) {
      SCOPED_TRACE(c10::str(torch::IntArrayRef(kShapes[i]), " step ", hp.step));
      const auto& state = static_cast<torch::optim::AdamWParamState&>(
          *reference.state().at(compat::OptimizerStateKey(theirs[i])));
      EXPECT_LE(MaxUlps(fused[i].param, theirs[i].detach()), AllowedUlps());
      EXPECT_LE(MaxUlps(fused[i].exp_avg, state.exp_avg()), AllowedUlps());
      EXPECT_LE(MaxUlps(fused[i].exp_avg_sq, state.exp_avg_sq()),
                AllowedUlps());
      // Gradients are read, never written.
      EXPECT_TRUE(torch::equal(fused[i].grad, raw_grads[i]));
    }
  }
  // The params really moved, so matching the reference means something.
  EXPECT_GT(fused.back().exp_avg.abs().sum().item<double>(), 0.0);
}

TEST_P(FusedOptimizerTest, SgdMatchesComposedOps) {
  torch::manual_seed(12);
  for (const UpdateHyperparameters& hp : Schedule()) {
    std::vector<UpdateOperands> fused;
    std::vector<torch::Tensor> expected;
    for (const auto& shape : kShapes) {
      const torch::Tensor p = Random(shape), g = Random(shape);
      fused.push_back({p.clone(), g.clone(), {}, {}});
      torch::Tensor composed = p.clone();
      if (hp.weight_decay != 0) {
        composed.mul_(1 - hp.learning_rate * hp.weight_decay);
      }
      composed.add_(g.clone().mul_(hp.grad_scale), -hp.learning_rate);
      expected.push_back(composed);
    }
    ASSERT_TRUE(kernels::FusedSgd(fused, hp).ok());
    for (size_t i = 0; i < kShapes.size(); ++i) {
      EXPECT_LE(MaxUlps(fused[i].param, expected[i]), AllowedUlps()) << i;
    }
  }
}

TEST_P(FusedOptimizerTest, ResultsDoNotDependOnTheThreadCount) {
  const int saved_threads = at::get_num_threads();
  torch::manual_seed(13);
  const torch::Tensor p = Random({300001}), g = Random({300001});
  const torch::Tensor m = Random({300001}), v = Random({300001}).abs();
  std::vector<torch::Tensor> params;
  for (int threads : {1, 3}) {
    at::set_num_threads(threads);
    std::vector<UpdateOperands> t = {{p.clone(), g, m.clone(), v.clone()}};
    ASSERT_TRUE(kernels::FusedAdamW(t, Schedule()[0]).ok());
    params.push_back(t[0].param);
  }
  at::set_num_threads(saved_threads);
  EXPECT_TRUE(torch::equal(params[0], params[1]));
}

TEST_P(FusedOptimizerTest, RejectsUnfusableOperandsAndChangesNothing) {
  const torch::Tensor p = Random({6, 4});
  const torch::ScalarType other_dtype =
      GetParam() == torch::kFloat ? torch::kDouble : torch::kFloat;
  struct Case {
    std::string name;
    UpdateOperands second;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"non-contiguous grad",
       {p.clone(), Random({4, 6}).t(), torch::zeros_like(p),
        torch::zeros_like(p)},
       "tensors[1].grad is not contiguous"},
      {"grad dtype",
       {p.clone(), torch::randn({6, 4}, other_dtype), torch::zeros_like(p),
        torch::zeros_like(p)},
       "tensors[1].grad has dtype"},
      {"moment shape",
       {p.clone(), Random({6, 4}), torch::zeros({24}, GetParam()),
        torch::zeros_like(p)},
       "tensors[1].exp_avg has shape [24]"},
      {"missing moment",
       {p.clone(), Random({6, 4}), torch::zeros_like(p), {}},
       "tensors[1].exp_avg_sq is undefined"},
      {"aliased grad",
       {p, p, torch::zeros_like(p), torch::zeros_like(p)},
       "must not share storage"},
      {"integer param",
       {torch::ones({3}, torch::kInt64), torch::ones({3}, torch::kInt64),
        torch::zeros({3}, torch::kInt64), torch::zeros({3}, torch::kInt64)},
       "tensors[1].param has dtype Long"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<UpdateOperands> tensors = {
        {p.clone(), Random({6, 4}), torch::zeros_like(p), torch::zeros_like(p)},
        c.second};
    const torch::Tensor first_before = tensors[0].param.clone();
    const absl::Status status = kernels::FusedAdamW(tensors, Schedule()[0]);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find(c.message), std::string::npos)
        << status.message();
    EXPECT_TRUE(torch::equal(tensors[0].param, first_before));
    EXPECT_TRUE(torch::equal(tensors[0].exp_avg, torch::zeros_like(p)));
  }
  std::vector<UpdateOperands> sgd = {
      {p.clone(), Random({6, 4}), torch::zeros_like(p), {}}};
  EXPECT_EQ(kernels::FusedSgd(sgd, Schedule()[0]).code(),
            absl::StatusCode::kInvalidArgument);
}

// OptimStep as the engine runs it (ComputeClip, then Optimizer::Step reading
// the raw gradients with the scale) against the composed path
// (NormalizeAndClip scaling in place, then torch::optim::AdamW), on a tiny
// llama whose parameters go through the fused kernels.
TEST_P(FusedOptimizerTest, ComputeClipThenStepMatchesNormalizeClipThenAdamW) {
  const DType dtype =
      GetParam() == torch::kFloat ? DType::kFloat32 : DType::kFloat64;
  auto ours = LlamaModel::Create(testing::TinyConfig(), dtype, 5).value();
  auto reference = LlamaModel::Create(testing::TinyConfig(), dtype, 5).value();
  std::unique_ptr<Communicator> world = MakeSingleRankCommunicator().value();
  const Mesh mesh = Mesh::SingleRank();
  Optimizer optimizer(OptimizerKind::kAdamW, &ours->parameters());
  std::vector<torch::Tensor> reference_tensors;
  for (Parameter& p : reference->parameters()) {
    reference_tensors.push_back(p.tensor);
  }
  AdamParams hp;
  hp.learning_rate = 1e-2;
  hp.weight_decay = 0.1;
  torch::optim::AdamW torch_adamw(reference_tensors,
                                  torch::optim::AdamWOptions(hp.learning_rate)
                                      .betas({hp.beta1, hp.beta2})
                                      .eps(hp.eps)
                                      .weight_decay(hp.weight_decay));
  torch::manual_seed(14);
  const double normalizer = 37;
  for (double max_norm : {0.0, 1e-3}) {  // unclipped, then clipped
    for (size_t i = 0; i < ours->parameters().size(); ++i) {
      const torch::Tensor raw =
          torch::randn_like(ours->parameters()[i].tensor.detach());
      ours->parameters()[i].tensor.mutable_grad() = raw.clone();
      reference->parameters()[i].tensor.mutable_grad() = raw.clone();
    }
    const std::vector<torch::Tensor> raw = testing::Gradients(*ours);
    const ClipResult fused = ComputeClip(ours->parameters(), normalizer, mesh,
                                         *world, NormType::kL2, max_norm)
                                 .value();
    const ClipResult composed =
        NormalizeAndClip(reference->parameters(), normalizer, mesh, *world,
                         NormType::kL2, max_norm)
            .value();
    EXPECT_EQ(fused.norm.total, composed.norm.total);
    EXPECT_EQ(fused.clip_coef, composed.clip_coef);
    EXPECT_EQ(max_norm > 0, fused.clip_coef < 1);
    ASSERT_TRUE(optimizer.Step(hp, fused.grad_scale).ok());
    torch_adamw.step();
    const std::vector<torch::Tensor> after = testing::Gradients(*ours);
    for (size_t i = 0; i < raw.size(); ++i) {
      EXPECT_LE(MaxUlps(ours->parameters()[i].tensor.detach(),
                        reference_tensors[i].detach()),
                AllowedUlps())
          << ours->parameters()[i].name;
      EXPECT_TRUE(torch::equal(after[i], raw[i]));  // left raw
    }
  }
}

// A parameter the kernels refuse (here non-contiguous) takes the composed
// ops, with the same result as torch::optim::AdamW on scaled gradients.
TEST_P(FusedOptimizerTest, NonContiguousParameterTakesTheComposedPath) {
  torch::manual_seed(15);
  const torch::Tensor start = Random({7, 5}).t();  // non-contiguous
  std::vector<Parameter> params = {
      {"w", start.clone(), {}, false},  // clone keeps the transposed strides
      {"b", Random({5}), {}, false}};
  ASSERT_FALSE(params[0].tensor.is_contiguous());
  std::vector<torch::Tensor> theirs = {
      params[0].tensor.clone().requires_grad_(),
      params[1].tensor.clone().requires_grad_()};
  Optimizer optimizer(OptimizerKind::kAdamW, &params);
  AdamParams hp;
  hp.learning_rate = 1e-2;
  torch::optim::AdamW reference(theirs,
                                torch::optim::AdamWOptions(hp.learning_rate)
                                    .weight_decay(hp.weight_decay));
  const double scale = 0.25;
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor g = torch::randn_like(params[i].tensor);
      params[i].tensor.mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g.clone().mul_(scale);
    }
    ASSERT_TRUE(optimizer.Step(hp, scale).ok());
    reference.step();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LE(MaxUlps(params[i].tensor, theirs[i].detach()), AllowedUlps())
          << i;
    }
  }
}

TEST_P(FusedOptimizerTest, NormOverManyShapesMatchesFp64Reference) {
  torch::manual_seed(16);
  std::vector<Parameter> params;
  long double squares = 0;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    // Magnitudes spread over decades, so summation order shows in the bits.
    torch::Tensor grad = Random(kShapes[i]) * std::pow(10.0, i % 5);
    Parameter p{"p" + std::to_string(i),
                torch::zeros(kShapes[i], GetParam()),
                {},
                false};
    p.tensor.mutable_grad() = grad;
    params.push_back(p);
    const torch::Tensor wide = grad.to(torch::kDouble).contiguous();
    for (int64_t j = 0; j < wide.numel(); ++j) {
      const long double x = wide.data_ptr<double>()[j];
      squares += x * x;
    }
  }
  std::unique_ptr<Communicator> world = MakeSingleRankCommunicator().value();
  const double normalizer = 3;
  const ClipResult clip = ComputeClip(params, normalizer, Mesh::SingleRank(),
                                      *world, NormType::kL2, 1.0)
                              .value();
  const double expected = static_cast<double>(std::sqrt(squares)) / normalizer;
  EXPECT_LT(std::fabs(clip.norm.total - expected), 1e-12 * expected);
  EXPECT_EQ(clip.grad_scale, clip.clip_coef / normalizer);
}

TEST_P(FusedOptimizerTest, NonFiniteGradientGivesNoScaleAndTouchesNothing) {
  std::unique_ptr<Communicator> world = MakeSingleRankCommunicator().value();
  for (double poison : {std::numeric_limits<double>::quiet_NaN(),
                        std::numeric_limits<double>::infinity()}) {
    std::vector<Parameter> params = {{"a", Random({40000}), {}, false},
                                     {"b", Random({3, 3}), {}, false}};
    params[0].tensor.mutable_grad() = Random({40000});
    params[1].tensor.mutable_grad() = Random({3, 3});
    params[1].tensor.mutable_grad()[2][1] = poison;
    const torch::Tensor grad_a = params[0].tensor.grad().clone();
    for (NormType type : {NormType::kL2, NormType::kInf}) {
      const ClipResult clip =
          ComputeClip(params, 2.0, Mesh::SingleRank(), *world, type, 1.0)
              .value();
      EXPECT_FALSE(std::isfinite(clip.norm.total));
      EXPECT_EQ(std::isnan(clip.norm.total), std::isnan(poison));
      EXPECT_EQ(clip.grad_scale, 0.0);
    }
    EXPECT_TRUE(torch::equal(params[0].tensor.grad(), grad_a));
  }
}

// The entries take the tensors of one device, cpu or cuda. Meta tensors stand
// in for a second device here: CUDA tensors cannot exist without a GPU.
TEST(FusedOptimizerDispatchTest, RefusesMixedAndUnsupportedDevices) {
  const auto meta = torch::TensorOptions().device(torch::kMeta);
  const torch::Tensor p = torch::randn({4});
  const torch::Tensor on_meta = torch::empty({4}, meta);
  struct Case {
    const char* name;
    std::vector<UpdateOperands> tensors;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"entries on two devices",
       {{p.clone(), torch::randn({4}), torch::zeros({4}), torch::zeros({4})},
        {on_meta, torch::empty({4}, meta), torch::empty({4}, meta),
         torch::empty({4}, meta)}},
       "tensors[1].param is on meta but tensors[0].param on cpu"},
      {"grad on another device than its param",
       {{p.clone(), on_meta, torch::zeros({4}), torch::zeros({4})}},
       "tensors[0].grad is on meta; expected the param's cpu"},
      {"a device that is neither cpu nor cuda",
       {{on_meta, torch::empty({4}, meta), torch::empty({4}, meta),
         torch::empty({4}, meta)}},
       "tensors[0].param is on meta; expected cpu or cuda"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const torch::Tensor first_before = c.tensors[0].param.clone();
    const absl::Status status = kernels::FusedAdamW(c.tensors, Schedule()[0]);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find(c.message), std::string::npos)
        << status.message();
    if (first_before.is_cpu()) {
      EXPECT_TRUE(torch::equal(c.tensors[0].param, first_before));
    }
  }
  std::vector<UpdateOperands> sgd = {
      {p.clone(), torch::randn({4}), {}, {}},
      {on_meta, torch::empty({4}, meta), {}, {}}};
  EXPECT_EQ(kernels::FusedSgd(sgd, Schedule()[0]).code(),
            absl::StatusCode::kInvalidArgument);
  try {
    kernels::MultiTensorGradStats({torch::randn({4}), on_meta});
    ADD_FAILURE() << "grad stats over two devices did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensors[1] is on meta"),
              std::string::npos)
        << e.what();
  }
}

// Without a CUDA LibTorch a CUDA tensor is refused, saying why (the build,
// not the input); tests/cuda/fused_optimizer_cuda_test.cc runs the CUDA path.
TEST(FusedOptimizerDispatchTest, CudaSupportNamesWhatTheBuildLacks) {
#if TALLY_TORCH_CUDA
  GTEST_SKIP() << "this LibTorch has CUDA: tests/cuda covers CUDA tensors";
#else
  const absl::Status support = kernels::CudaTensorSupport();
  EXPECT_EQ(support.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(support.message().find("LibTorch has no CUDA"), std::string::npos)
      << support.message();
  EXPECT_EQ(kernels::FusedSgdCudaTensors({}, Schedule()[0]).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kernels::GradStatsCudaTensors({}).status().code(),
            absl::StatusCode::kFailedPrecondition);
#endif
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedOptimizerTest,
                         ::testing::Values(torch::kFloat, torch::kDouble),
                         [](const auto& info) {
                           return std::string(c10::toString(info.param));
                         });

}  // namespace
}  // namespace tally
