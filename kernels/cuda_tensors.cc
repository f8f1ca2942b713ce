#include "kernels/cuda_tensors.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"

// TALLY_TORCH_CUDA: the LibTorch build has CUDA (defined by the top-level
// CMakeLists.txt; an undefined macro reads as 0). TALLY_CUDA_KERNELS:
// kernels/cuda/ is built and linked (kernels/CMakeLists.txt).
#if TALLY_TORCH_CUDA && TALLY_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "kernels/cuda/fused_optimizer_cuda.h"
#include "kernels/cuda/grad_stats_cuda.h"
#endif

namespace tally::kernels {

#if TALLY_TORCH_CUDA && TALLY_CUDA_KERNELS
namespace {

absl::Status FromCuda(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(call, " failed: ", cudaGetErrorName(error), " (",
                   cudaGetErrorString(error), ")"));
}

// The raw pointers of the entries of one dtype, as the CUDA kernels take them.
template <typename T>
struct PointerTable {
  std::vector<T*> params, exp_avgs, exp_avg_sqs;
  std::vector<const T*> grads;
  std::vector<int64_t> sizes;

  int count() const { return static_cast<int>(sizes.size()); }
};

template <typename T>
PointerTable<T> TableOf(const std::vector<UpdateOperands>& tensors,
                        bool with_moments) {
  const torch::ScalarType dtype =
      std::is_same_v<T, float> ? torch::kFloat : torch::kDouble;
  PointerTable<T> table;
  for (const UpdateOperands& t : tensors) {
    if (t.param.scalar_type() != dtype) continue;
    table.params.push_back(t.param.data_ptr<T>());
    table.grads.push_back(t.grad.data_ptr<T>());
    if (with_moments) {
      table.exp_avgs.push_back(t.exp_avg.data_ptr<T>());
      table.exp_avg_sqs.push_back(t.exp_avg_sq.data_ptr<T>());
    }
    table.sizes.push_back(t.param.numel());
  }
  return table;
}

template <typename T>
absl::Status LaunchAdamW(const std::vector<UpdateOperands>& tensors,
                         const UpdateHyperparameters& hp, cudaStream_t stream) {
  const PointerTable<T> t = TableOf<T>(tensors, /*with_moments=*/true);
  if (t.count() == 0) return absl::OkStatus();
  return FromCuda(FusedAdamWCuda(t.params.data(), t.grads.data(),
                                 t.exp_avgs.data(), t.exp_avg_sqs.data(),
                                 t.sizes.data(), t.count(), hp, stream),
                  "FusedAdamWCuda");
}

template <typename T>
absl::Status LaunchSgd(const std::vector<UpdateOperands>& tensors,
                       const UpdateHyperparameters& hp, cudaStream_t stream) {
  const PointerTable<T> t = TableOf<T>(tensors, /*with_moments=*/false);
  if (t.count() == 0) return absl::OkStatus();
  return FromCuda(FusedSgdCuda(t.params.data(), t.grads.data(), t.sizes.data(),
                               t.count(), hp, stream),
                  "FusedSgdCuda");
}

// Runs launch(stream) with the entries' device current and its current
// stream (the stream LibTorch queues the step's other work on).
template <typename Launch>
absl::Status OnDeviceOf(const torch::Tensor& tensor, Launch launch) {
  const c10::cuda::CUDAGuard guard(tensor.device());
  return launch(
      c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream());
}

// Launches GradStatsCuda over the `dtype` tensors, writing `*result` on the
// device; `*launched` tells whether there were any.
template <typename T>
absl::Status LaunchGradStats(const std::vector<torch::Tensor>& contiguous,
                             CudaGradStats* result, cudaStream_t stream,
                             bool* launched) {
  const torch::ScalarType dtype =
      std::is_same_v<T, float> ? torch::kFloat : torch::kDouble;
  std::vector<const T*> pointers;
  std::vector<int64_t> sizes;
  for (const torch::Tensor& tensor : contiguous) {
    if (!tensor.defined() || tensor.scalar_type() != dtype) continue;
    pointers.push_back(tensor.data_ptr<T>());
    sizes.push_back(tensor.numel());
  }
  *launched = !pointers.empty();
  if (!*launched) return absl::OkStatus();
  return FromCuda(
      GradStatsCuda(pointers.data(), sizes.data(),
                    static_cast<int>(pointers.size()), result, stream),
      "GradStatsCuda");
}

// The statistics of two disjoint sets of elements as those of their union,
// with MultiTensorGradStats's NaN rules.
GradStats Merge(const GradStats& a, const CudaGradStats& b) {
  GradStats merged;
  merged.sum_squares = a.sum_squares + b.sum_squares;
  merged.max_abs = std::isnan(a.max_abs) || std::isnan(b.max_abs)
                       ? std::nan("")
                       : std::fmax(a.max_abs, b.max_abs);
  merged.nonfinite = a.nonfinite || b.nonfinite != 0;
  return merged;
}

}  // namespace

absl::Status CudaTensorSupport() { return absl::OkStatus(); }

absl::Status FusedAdamWCudaTensors(const std::vector<UpdateOperands>& tensors,
                                   const UpdateHyperparameters& hp) {
  if (tensors.empty()) return absl::OkStatus();
  return OnDeviceOf(tensors.front().param, [&](cudaStream_t stream) {
    absl::Status status = LaunchAdamW<float>(tensors, hp, stream);
    if (status.ok()) status = LaunchAdamW<double>(tensors, hp, stream);
    return status;
  });
}

absl::Status FusedSgdCudaTensors(const std::vector<UpdateOperands>& tensors,
                                 const UpdateHyperparameters& hp) {
  if (tensors.empty()) return absl::OkStatus();
  return OnDeviceOf(tensors.front().param, [&](cudaStream_t stream) {
    absl::Status status = LaunchSgd<float>(tensors, hp, stream);
    if (status.ok()) status = LaunchSgd<double>(tensors, hp, stream);
    return status;
  });
}

absl::StatusOr<GradStats> GradStatsCudaTensors(
    const std::vector<torch::Tensor>& tensors) {
  // Contiguous tensors are shared, not copied; copies live until the result
  // is on the host, after every kernel that reads them.
  std::vector<torch::Tensor> contiguous;
  const torch::Tensor* first = nullptr;
  for (const torch::Tensor& tensor : tensors) {
    contiguous.push_back(tensor.defined() ? tensor.contiguous()
                                          : torch::Tensor());
    if (first == nullptr && tensor.defined()) first = &tensor;
  }
  if (first == nullptr) return GradStats();
  // One result per dtype group, in one device buffer: one copy to the host.
  const torch::Tensor results = torch::zeros(
      {static_cast<int64_t>(2 * sizeof(CudaGradStats))},
      torch::TensorOptions().dtype(torch::kUInt8).device(first->device()));
  auto* device_results = reinterpret_cast<CudaGradStats*>(results.data_ptr());
  bool launched[2] = {false, false};
  const absl::Status status = OnDeviceOf(*first, [&](cudaStream_t stream) {
    absl::Status s = LaunchGradStats<float>(contiguous, &device_results[0],
                                            stream, &launched[0]);
    if (s.ok()) {
      s = LaunchGradStats<double>(contiguous, &device_results[1], stream,
                                  &launched[1]);
    }
    return s;
  });
  if (!status.ok()) return status;
  // On the current stream, after the kernels; blocks until it is done.
  const torch::Tensor host = results.to(torch::kCPU);
  const auto* host_results =
      reinterpret_cast<const CudaGradStats*>(host.data_ptr());
  GradStats stats;
  for (int group = 0; group < 2; ++group) {
    if (launched[group]) stats = Merge(stats, host_results[group]);
  }
  return stats;
}

#else  // !(TALLY_TORCH_CUDA && TALLY_CUDA_KERNELS)

absl::Status CudaTensorSupport() {
#if !TALLY_TORCH_CUDA
  return absl::FailedPreconditionError(
      "this build's LibTorch has no CUDA support (a CPU-only LibTorch); build "
      "tally against a CUDA LibTorch to update CUDA tensors");
#else
  return absl::FailedPreconditionError(
      "tally was built without its CUDA kernels (TALLY_CUDA_ENABLED is off: "
      "no nvcc or no nccl.h at configure time)");
#endif
}

absl::Status FusedAdamWCudaTensors(const std::vector<UpdateOperands>&,
                                   const UpdateHyperparameters&) {
  return CudaTensorSupport();
}

absl::Status FusedSgdCudaTensors(const std::vector<UpdateOperands>&,
                                 const UpdateHyperparameters&) {
  return CudaTensorSupport();
}

absl::StatusOr<GradStats> GradStatsCudaTensors(
    const std::vector<torch::Tensor>&) {
  return CudaTensorSupport();
}

#endif  // TALLY_TORCH_CUDA && TALLY_CUDA_KERNELS

}  // namespace tally::kernels
