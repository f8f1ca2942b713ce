#include "kernels/cuda/grad_stats_cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tests/cuda/cuda_device.h"

namespace tally::kernels {
namespace {

// Skips the calling test, naming why, unless a CUDA device is usable.
#define TALLY_SKIP_WITHOUT_CUDA_DEVICE()                       \
  do {                                                         \
    if (auto reason = ::tally::testing::MissingCudaDevice()) { \
      GTEST_SKIP() << *reason;                                 \
    }                                                          \
  } while (false)

struct CudaFree {
  void operator()(void* pointer) const { cudaFree(pointer); }
};

template <typename T>
using DevicePtr = std::unique_ptr<T, CudaFree>;

template <typename T>
DevicePtr<T> CopyToDevice(const std::vector<T>& host) {
  if (host.empty()) return nullptr;
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, host.size() * sizeof(T)), cudaSuccess);
  DevicePtr<T> owned(device);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  return owned;
}

template <typename T>
CudaGradStats RunOnDevice(const std::vector<std::vector<T>>& tensors) {
  std::vector<DevicePtr<T>> buffers;
  std::vector<const T*> pointers;
  std::vector<int64_t> sizes;
  for (const std::vector<T>& tensor : tensors) {
    buffers.push_back(CopyToDevice(tensor));
    pointers.push_back(buffers.back().get());
    sizes.push_back(static_cast<int64_t>(tensor.size()));
  }
  CudaGradStats* device_result = nullptr;
  EXPECT_EQ(cudaMalloc(&device_result, sizeof(CudaGradStats)), cudaSuccess);
  DevicePtr<CudaGradStats> owned_result(device_result);
  EXPECT_EQ(GradStatsCuda(pointers.data(), sizes.data(),
                          static_cast<int>(tensors.size()), device_result,
                          /*stream=*/nullptr),
            cudaSuccess);
  CudaGradStats stats{};
  EXPECT_EQ(
      cudaMemcpy(&stats, device_result, sizeof(stats), cudaMemcpyDeviceToHost),
      cudaSuccess);
  return stats;
}

// Serial reference on the host, summed in long double so that its own
// rounding is negligible next to the 1e-12 tolerance.
template <typename T>
CudaGradStats ComputeOnHost(const std::vector<std::vector<T>>& tensors) {
  long double sum_squares = 0.0L;
  double max_abs = 0.0;
  for (const std::vector<T>& tensor : tensors) {
    for (T x : tensor) {
      const double wide = static_cast<double>(x);
      sum_squares += static_cast<long double>(wide) * wide;
      max_abs = std::max(max_abs, std::fabs(wide));
    }
  }
  return {static_cast<double>(sum_squares), max_abs, 0};
}

template <typename T>
std::vector<T> RandomValues(int64_t size, std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  std::vector<T> values(size);
  // Magnitudes spread over decades, so summation order shows in the bits.
  for (T& value : values) {
    value = static_cast<T>(normal(rng) * std::exp(3.0 * normal(rng)));
  }
  return values;
}

template <typename T>
class GradStatsCudaTest : public ::testing::Test {
 protected:
  std::mt19937_64 rng_{20240611};
};

using FloatTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GradStatsCudaTest, FloatTypes);

TYPED_TEST(GradStatsCudaTest, MatchesHostReference) {
  TALLY_SKIP_WITHOUT_CUDA_DEVICE();
  std::vector<std::vector<TypeParam>> all;
  for (int64_t size :
       {0, 1, 7, 255, 256, 16383, 16384, 16385, 65537, 200003, 1 << 20}) {
    SCOPED_TRACE(size);
    std::vector<std::vector<TypeParam>> one = {
        RandomValues<TypeParam>(size, this->rng_)};
    const CudaGradStats expected = ComputeOnHost(one);
    const CudaGradStats actual = RunOnDevice(one);
    EXPECT_NEAR(actual.sum_squares, expected.sum_squares,
                1e-12 * expected.sum_squares);
    EXPECT_EQ(actual.max_abs, expected.max_abs);
    EXPECT_EQ(actual.nonfinite, 0);
    all.push_back(std::move(one.front()));
  }
  const CudaGradStats expected = ComputeOnHost(all);
  const CudaGradStats actual = RunOnDevice(all);
  EXPECT_NEAR(actual.sum_squares, expected.sum_squares,
              1e-12 * expected.sum_squares);
  EXPECT_EQ(actual.max_abs, expected.max_abs);
  // The same launch layout must reproduce the same bits.
  const CudaGradStats again = RunOnDevice(all);
  EXPECT_EQ(again.sum_squares, actual.sum_squares);
}

TYPED_TEST(GradStatsCudaTest, EmptyListGivesZero) {
  TALLY_SKIP_WITHOUT_CUDA_DEVICE();
  const CudaGradStats stats = RunOnDevice<TypeParam>({{}, {}});
  EXPECT_EQ(stats.sum_squares, 0.0);
  EXPECT_EQ(stats.max_abs, 0.0);
  EXPECT_EQ(stats.nonfinite, 0);
}

TYPED_TEST(GradStatsCudaTest, ReportsNaNAndInf) {
  TALLY_SKIP_WITHOUT_CUDA_DEVICE();
  constexpr TypeParam kInf = std::numeric_limits<TypeParam>::infinity();
  for (TypeParam poison :
       {std::numeric_limits<TypeParam>::quiet_NaN(), kInf, -kInf}) {
    SCOPED_TRACE(poison);
    std::vector<std::vector<TypeParam>> tensors = {
        RandomValues<TypeParam>(100, this->rng_),
        RandomValues<TypeParam>(40000, this->rng_)};
    tensors[1][39999] = poison;
    const CudaGradStats stats = RunOnDevice(tensors);
    if (std::isnan(poison)) {
      EXPECT_TRUE(std::isnan(stats.sum_squares));
      EXPECT_TRUE(std::isnan(stats.max_abs));
    } else {
      EXPECT_EQ(stats.sum_squares, std::numeric_limits<double>::infinity());
      EXPECT_EQ(stats.max_abs, std::numeric_limits<double>::infinity());
    }
    EXPECT_EQ(stats.nonfinite, 1);
  }
}

TEST(GradStatsCudaFloatTest, HugeFloatsStayFiniteInDouble) {
  TALLY_SKIP_WITHOUT_CUDA_DEVICE();
  const std::vector<std::vector<float>> tensors = {
      std::vector<float>(100001, 1e20f)};
  const double element = static_cast<double>(1e20f);
  const CudaGradStats stats = RunOnDevice(tensors);
  EXPECT_NEAR(stats.sum_squares, 100001 * element * element,
              1e-12 * 100001 * element * element);
  EXPECT_EQ(stats.max_abs, element);
  EXPECT_EQ(stats.nonfinite, 0);
}

// Argument checks happen on the host before any CUDA call, so this runs
// without a device.
TEST(GradStatsCudaArgumentsTest, RejectsInvalidArguments) {
  // Never written: every call below is rejected before any work is queued.
  CudaGradStats untouched{};
  CudaGradStats* unused_result = &untouched;
  const float* tensors[] = {nullptr};
  const int64_t negative[] = {-1};
  const int64_t positive[] = {5};
  EXPECT_EQ(GradStatsCuda(tensors, negative, 1, unused_result, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(GradStatsCuda(tensors, positive, 1, unused_result, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(GradStatsCuda(tensors, positive, -1, unused_result, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(GradStatsCuda(tensors, positive, 0, nullptr, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace tally::kernels
