// DeviceQuery through the CUDA runtime API (and NCCL's version when the
// build links NCCL: TALLY_DEVICE_QUERY_NCCL).
#include "runtime/parallel/device_query.h"

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#if TALLY_DEVICE_QUERY_NCCL
#include <nccl.h>
#endif

namespace tally {
namespace {

// CUDA encodes versions as 1000 * major + 10 * minor.
std::string CudaVersionText(int version) {
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

std::string NcclVersionText() {
#if TALLY_DEVICE_QUERY_NCCL
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version <= 0) return "";
  // NCCL >= 2.9 encodes 10000 * major + 100 * minor + patch.
  return absl::StrCat(version / 10000, ".", (version % 10000) / 100, ".",
                      version % 100);
#else
  return "";
#endif
}

std::string ErrorText(const char* call, cudaError_t error) {
  return absl::StrCat(call, ": ", cudaGetErrorString(error));
}

}  // namespace

CudaFacts QueryCudaFacts() {
  CudaFacts facts;
  facts.built_with_cuda = true;
  int version = 0;
  if (cudaDriverGetVersion(&version) == cudaSuccess && version > 0) {
    facts.driver_version = CudaVersionText(version);
  }
  if (cudaRuntimeGetVersion(&version) == cudaSuccess && version > 0) {
    facts.runtime_version = CudaVersionText(version);
  }
  facts.nccl_version = NcclVersionText();
  int count = 0;
  const cudaError_t counted = cudaGetDeviceCount(&count);
  if (counted != cudaSuccess) {
    // No driver or no device: zero GPUs. Clears the runtime's sticky error.
    cudaGetLastError();
    facts.no_gpu_reason = ErrorText("cudaGetDeviceCount", counted);
    return facts;
  }
  if (count == 0) facts.no_gpu_reason = "the CUDA runtime sees no GPU";
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp props{};
    const cudaError_t got = cudaGetDeviceProperties(&props, i);
    if (got != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    facts.gpus.push_back(GpuFacts{i, props.name, props.major, props.minor,
                                  static_cast<int64_t>(props.totalGlobalMem)});
  }
  return facts;
}

absl::StatusOr<DeviceMemoryInfo> QueryDeviceMemory(int index) {
  cudaError_t error = cudaSetDevice(index);
  if (error == cudaSuccess) {
    size_t free_bytes = 0, total_bytes = 0;
    error = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (error == cudaSuccess) {
      return DeviceMemoryInfo{static_cast<int64_t>(free_bytes),
                              static_cast<int64_t>(total_bytes)};
    }
  }
  cudaGetLastError();
  return absl::FailedPreconditionError(
      absl::StrCat("GPU ", index, ": ", ErrorText("cudaMemGetInfo", error)));
}

}  // namespace tally
