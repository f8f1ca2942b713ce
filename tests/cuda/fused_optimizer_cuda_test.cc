// The CUDA fused optimizer updates against the composed LibTorch path on the
// CPU (grad.mul_(scale), then torch::optim::AdamW or the SGD ops). Tests that
// need a device report themselves skipped without one.
#include "kernels/cuda/fused_optimizer_cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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

// Within a few roundings of the reference.
void ExpectClose(const torch::Tensor& actual, const torch::Tensor& expected) {
  const double eps = actual.scalar_type() == torch::kFloat ? 6e-8 : 1.2e-16;
  EXPECT_TRUE(torch::allclose(actual, expected, 8 * eps, 1e-30))
      << (actual - expected).abs().max().item<double>();
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
              c10::guts::to_string(reference_params[i].unsafeGetTensorImpl())));
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
