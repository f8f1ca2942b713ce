// The CUDA fused optimizer updates against the composed LibTorch path on the
// CPU (grad.mul_(scale), then torch::optim::AdamW or the SGD ops), and the
// tensor-level entries (kernels/fused_optimizer.h, kernels/grad_stats.h) on
// CUDA tensors against the same entries on CPU tensors. Tests that need a
// device, or a LibTorch with CUDA, report themselves skipped without one.
#include "kernels/cuda/fused_optimizer_cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/fused_optimizer.h"
#include "kernels/grad_stats.h"
#include "runtime/parallel/torch_compat.h"
#include "tests/cuda/cuda_device.h"

namespace tally::kernels {
namespace {

// Sizes across the chunk (16384 elements) and block (256) sizes.
const std::vector<int64_t> kSizes = {0, 1, 255, 257, 16384, 16385, 100003};

struct CudaFree {
  void operator()(void* pointer) const { cudaFree(pointer); }
};

// A device copy of a contiguous CPU tensor, freed with the object.
class DeviceTensor {
 public:
  explicit DeviceTensor(const torch::Tensor& host) : host_(host.clone()) {
    void* device = nullptr;
    if (host_.nbytes() > 0) {
      EXPECT_EQ(cudaMalloc(&device, host_.nbytes()), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(device, host_.data_ptr(), host_.nbytes(),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    device_.reset(device);
  }
  template <typename T>
  T* data() const {
    return static_cast<T*>(device_.get());
  }
  torch::Tensor ToHost() const {
    torch::Tensor out = torch::empty_like(host_);
    if (out.nbytes() > 0) {
      EXPECT_EQ(cudaMemcpy(out.data_ptr(), device_.get(), out.nbytes(),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return out;
  }

 private:
  torch::Tensor host_;
  std::unique_ptr<void, CudaFree> device_;
};

// Within a few roundings of the reference at the tensor's scale: an element
// the update cancelled to near zero keeps the rounding of the values it came
// from, and LibTorch 2.x's AdamW orders its operations unlike 1.13's, so an
// elementwise relative bound asks more than either can give (seen on an H200
// with torch 2.11: 1 ulp of the scale on elements near zero).
void ExpectClose(const torch::Tensor& actual, const torch::Tensor& expected) {
  const double eps = actual.scalar_type() == torch::kFloat ? 6e-8 : 1.2e-16;
  const double scale = expected.abs().max().item<double>();
  EXPECT_LE((actual - expected).abs().max().item<double>(), 8 * eps * scale);
}

template <typename T>
class FusedOptimizerCudaTest : public ::testing::Test {
 protected:
  torch::ScalarType dtype() const {
    return std::is_same_v<T, float> ? torch::kFloat : torch::kDouble;
  }
};

using FloatTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(FusedOptimizerCudaTest, FloatTypes);

TYPED_TEST(FusedOptimizerCudaTest, AdamWMatchesTorchOptimAdamWOnTheCpu) {
  if (auto reason = ::tally::testing::MissingCudaDevice()) {
    GTEST_SKIP() << *reason;
  }
  using T = TypeParam;
  torch::manual_seed(21);
  std::vector<torch::Tensor> reference_params;
  std::vector<DeviceTensor> params, exp_avgs, exp_avg_sqs;
  for (int64_t size : kSizes) {
    const torch::Tensor p = torch::randn({size}, this->dtype());
    reference_params.push_back(p.clone().requires_grad_());
    params.emplace_back(p);
    exp_avgs.emplace_back(torch::zeros_like(p));
    exp_avg_sqs.emplace_back(torch::zeros_like(p));
  }
  torch::optim::AdamW reference(reference_params);
  for (int64_t step = 1; step <= 3; ++step) {
    UpdateHyperparameters hp;
    hp.learning_rate = 1e-2 * step;
    hp.weight_decay = step == 2 ? 0.0 : 0.1;
    hp.step = step;
    hp.grad_scale = 1.0 / (3 * step);
    std::vector<DeviceTensor> grads;
    std::vector<T*> p_ptrs, m_ptrs, v_ptrs;
    std::vector<const T*> g_ptrs;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      const torch::Tensor g = torch::randn({kSizes[i]}, this->dtype());
      reference_params[i].mutable_grad() = g.clone().mul_(hp.grad_scale);
      grads.emplace_back(g);
      p_ptrs.push_back(params[i].template data<T>());
      g_ptrs.push_back(grads[i].template data<T>());
      m_ptrs.push_back(exp_avgs[i].template data<T>());
      v_ptrs.push_back(exp_avg_sqs[i].template data<T>());
    }
    static_cast<torch::optim::AdamWOptions&>(
        reference.param_groups()[0].options())
        .lr(hp.learning_rate)
        .weight_decay(hp.weight_decay);
    reference.step();
    ASSERT_EQ(FusedAdamWCuda(p_ptrs.data(), g_ptrs.data(), m_ptrs.data(),
                             v_ptrs.data(), kSizes.data(),
                             static_cast<int>(kSizes.size()), hp,
                             /*stream=*/nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < kSizes.size(); ++i) {
      SCOPED_TRACE(kSizes[i]);
      const auto& state =
          static_cast<torch::optim::AdamWParamState&>(*reference.state().at(
              compat::OptimizerStateKey(reference_params[i])));
      ExpectClose(params[i].ToHost(), reference_params[i].detach());
      ExpectClose(exp_avgs[i].ToHost(), state.exp_avg());
      ExpectClose(exp_avg_sqs[i].ToHost(), state.exp_avg_sq());
    }
  }
}

TYPED_TEST(FusedOptimizerCudaTest, SgdMatchesComposedOpsOnTheCpu) {
  if (auto reason = ::tally::testing::MissingCudaDevice()) {
    GTEST_SKIP() << *reason;
  }
  using T = TypeParam;
  torch::manual_seed(22);
  UpdateHyperparameters hp;
  hp.learning_rate = 0.05;
  hp.weight_decay = 0.01;
  hp.grad_scale = 0.125;
  std::vector<DeviceTensor> params, grads;
  std::vector<torch::Tensor> expected;
  std::vector<T*> p_ptrs;
  std::vector<const T*> g_ptrs;
  for (int64_t size : kSizes) {
    const torch::Tensor p = torch::randn({size}, this->dtype());
    const torch::Tensor g = torch::randn({size}, this->dtype());
    expected.push_back(
        p.clone()
            .mul_(1 - hp.learning_rate * hp.weight_decay)
            .add_(g.clone().mul_(hp.grad_scale), -hp.learning_rate));
    params.emplace_back(p);
    grads.emplace_back(g);
    p_ptrs.push_back(params.back().template data<T>());
    g_ptrs.push_back(grads.back().template data<T>());
  }
  ASSERT_EQ(FusedSgdCuda(p_ptrs.data(), g_ptrs.data(), kSizes.data(),
                         static_cast<int>(kSizes.size()), hp, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    ExpectClose(params[i].ToHost(), expected[i]);
  }
}

// Why CUDA tensors cannot be made here, or nullopt when they can.
std::optional<std::string> MissingCudaTensors() {
#if !TALLY_TORCH_CUDA
  return std::string(
      "this LibTorch has no CUDA (TALLY_TORCH_CUDA is 0): no CUDA tensors");
#else
  if (auto reason = ::tally::testing::MissingCudaDevice()) return reason;
  if (!torch::cuda::is_available()) {
    return std::string("torch::cuda::is_available() is false");
  }
  return std::nullopt;
#endif
}

#define TALLY_SKIP_WITHOUT_CUDA_TENSORS()     \
  do {                                        \
    if (auto reason = MissingCudaTensors()) { \
      GTEST_SKIP() << *reason;                \
    }                                         \
  } while (false)

// The bound of the tensor-level comparisons, CUDA against CPU: the same
// operations, each correctly rounded on both (-fmad=false, IEEE sqrt and
// division), so bitwise equal where the CPU runs its AVX2 + FMA clones and
// within an ulp per operation elsewhere (a dozen operations per element).
void ExpectSameAsCpu(const torch::Tensor& cuda, const torch::Tensor& cpu) {
  ASSERT_TRUE(cuda.is_cuda());
  const torch::Tensor actual = cuda.cpu();
  const double rtol = cpu.scalar_type() == torch::kFloat ? 16 * 6e-8 : 1e-12;
  EXPECT_TRUE(torch::allclose(actual, cpu, rtol, /*atol=*/1e-30))
      << "max |diff| " << (actual - cpu).abs().max().item<double>();
}

// One list of both dtypes (two launches, one per dtype) across the chunk and
// block sizes; every CPU entry has a CUDA twin with the same values.
struct TwinOperands {
  std::vector<UpdateOperands> cpu, cuda;
};

TwinOperands MakeTwins(bool with_moments) {
  TwinOperands twins;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const torch::ScalarType dtype = i % 2 == 0 ? torch::kFloat : torch::kDouble;
    UpdateOperands cpu;
    cpu.param = torch::randn({kSizes[i]}, dtype);
    if (with_moments) {
      cpu.exp_avg = torch::zeros_like(cpu.param);
      cpu.exp_avg_sq = torch::zeros_like(cpu.param);
    }
    UpdateOperands cuda;
    cuda.param = cpu.param.to(torch::kCUDA);
    if (with_moments) {
      cuda.exp_avg = cpu.exp_avg.to(torch::kCUDA);
      cuda.exp_avg_sq = cpu.exp_avg_sq.to(torch::kCUDA);
    }
    twins.cpu.push_back(std::move(cpu));
    twins.cuda.push_back(std::move(cuda));
  }
  return twins;
}

void SetGradients(TwinOperands& twins) {
  for (size_t i = 0; i < twins.cpu.size(); ++i) {
    twins.cpu[i].grad = torch::randn_like(twins.cpu[i].param);
    twins.cuda[i].grad = twins.cpu[i].grad.to(torch::kCUDA);
  }
}

TEST(FusedOptimizerCudaTensorsTest, AdamWOnCudaTensorsMatchesTheCpuKernels) {
  TALLY_SKIP_WITHOUT_CUDA_TENSORS();
  torch::manual_seed(23);
  TwinOperands twins = MakeTwins(/*with_moments=*/true);
  for (int64_t step = 1; step <= 3; ++step) {
    SetGradients(twins);
    UpdateHyperparameters hp;
    hp.learning_rate = 1e-2 * step;
    hp.weight_decay = step == 2 ? 0.0 : 0.1;
    hp.step = step;
    hp.grad_scale = 1.0 / (3 * step);
    ASSERT_TRUE(FusedAdamW(twins.cpu, hp).ok());
    const absl::Status status = FusedAdamW(twins.cuda, hp);
    ASSERT_TRUE(status.ok()) << status;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " entry " << i);
      ExpectSameAsCpu(twins.cuda[i].param, twins.cpu[i].param);
      ExpectSameAsCpu(twins.cuda[i].exp_avg, twins.cpu[i].exp_avg);
      ExpectSameAsCpu(twins.cuda[i].exp_avg_sq, twins.cpu[i].exp_avg_sq);
      // Gradients are only read.
      EXPECT_TRUE(torch::equal(twins.cuda[i].grad.cpu(), twins.cpu[i].grad));
    }
  }
}

TEST(FusedOptimizerCudaTensorsTest, SgdOnCudaTensorsMatchesTheCpuKernels) {
  TALLY_SKIP_WITHOUT_CUDA_TENSORS();
  torch::manual_seed(24);
  TwinOperands twins = MakeTwins(/*with_moments=*/false);
  SetGradients(twins);
  UpdateHyperparameters hp;
  hp.learning_rate = 0.05;
  hp.weight_decay = 0.01;
  hp.grad_scale = 0.125;
  ASSERT_TRUE(FusedSgd(twins.cpu, hp).ok());
  const absl::Status status = FusedSgd(twins.cuda, hp);
  ASSERT_TRUE(status.ok()) << status;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    SCOPED_TRACE(i);
    ExpectSameAsCpu(twins.cuda[i].param, twins.cpu[i].param);
  }
}

TEST(FusedOptimizerCudaTensorsTest, RefusesCpuAndCudaInOneCall) {
  TALLY_SKIP_WITHOUT_CUDA_TENSORS();
  const torch::Tensor p = torch::randn({8});
  std::vector<UpdateOperands> mixed = {
      {p.clone(), torch::randn({8}), {}, {}},
      {p.to(torch::kCUDA), torch::randn({8}).to(torch::kCUDA), {}, {}}};
  const absl::Status status = FusedSgd(mixed, UpdateHyperparameters());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(torch::equal(mixed[0].param, p));
  std::vector<UpdateOperands> grad_elsewhere = {
      {p.to(torch::kCUDA), torch::randn({8}), {}, {}}};
  EXPECT_EQ(FusedSgd(grad_elsewhere, UpdateHyperparameters()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THROW(MultiTensorGradStats({p, p.to(torch::kCUDA)}), c10::Error);
}

// Squares are summed in fp64 on both, in another order: within 1e-12
// relative; the largest magnitude and the flags are exact.
void ExpectSameStats(const GradStats& cuda, const GradStats& cpu) {
  EXPECT_NEAR(cuda.sum_squares, cpu.sum_squares, 1e-12 * cpu.sum_squares);
  EXPECT_EQ(cuda.max_abs, cpu.max_abs);
  EXPECT_EQ(cuda.nonfinite, cpu.nonfinite);
}

std::vector<torch::Tensor> ToCuda(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& t : tensors) {
    out.push_back(t.defined() ? t.to(torch::kCUDA) : torch::Tensor());
  }
  return out;
}

TEST(FusedOptimizerCudaTensorsTest, GradStatsOnCudaTensorsMatchTheCpu) {
  TALLY_SKIP_WITHOUT_CUDA_TENSORS();
  torch::manual_seed(25);
  // Both dtypes, an undefined entry and a non-contiguous one.
  std::vector<torch::Tensor> tensors = {
      torch::randn({100003}, torch::kFloat) * 1e3, torch::Tensor(),
      torch::randn({257, 129}, torch::kDouble).t(),
      torch::randn({16385}, torch::kFloat),
      torch::full({3}, 1e20, torch::kFloat)};
  ExpectSameStats(MultiTensorGradStats(ToCuda(tensors)),
                  MultiTensorGradStats(tensors));
  for (double poison : {std::numeric_limits<double>::quiet_NaN(),
                        std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(poison);
    std::vector<torch::Tensor> poisoned = tensors;
    poisoned[3] = poisoned[3].clone();
    poisoned[3][16384] = poison;
    const GradStats cuda = MultiTensorGradStats(ToCuda(poisoned));
    const GradStats cpu = MultiTensorGradStats(poisoned);
    EXPECT_TRUE(cuda.nonfinite);
    EXPECT_EQ(std::isnan(cuda.sum_squares), std::isnan(cpu.sum_squares));
    EXPECT_EQ(std::isnan(cuda.max_abs), std::isnan(cpu.max_abs));
    if (!std::isnan(poison)) {
      EXPECT_EQ(cuda.max_abs, cpu.max_abs);
      EXPECT_EQ(cuda.sum_squares, cpu.sum_squares);
    }
  }
}

// Argument checks happen on the host before any CUDA call, so this runs
// without a device.
TEST(FusedOptimizerCudaArgumentsTest, RejectsInvalidArguments) {
  float* buffers[] = {nullptr};
  const float* const_buffers[] = {nullptr};
  const int64_t negative[] = {-1};
  const int64_t positive[] = {5};
  const UpdateHyperparameters hp;
  EXPECT_EQ(FusedAdamWCuda(buffers, const_buffers, buffers, buffers, negative,
                           1, hp, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(FusedAdamWCuda(buffers, const_buffers, buffers, buffers, positive,
                           1, hp, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(FusedAdamWCuda(buffers, const_buffers, nullptr, buffers, positive,
                           1, hp, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(FusedSgdCuda(buffers, const_buffers, positive, -1, hp, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(FusedSgdCuda(buffers, const_buffers, positive, 1, hp, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace tally::kernels
