// DeviceQuery for builds without the CUDA pieces (TALLY_CUDA_ENABLED off).
#include "absl/status/status.h"
#include "runtime/parallel/device_query.h"

namespace tally {

namespace {
constexpr char kNoCuda[] =
    "this tally build has no CUDA pieces (configure with "
    "-DTALLY_WITH_CUDA=ON on a host with nvcc and NCCL)";
}  // namespace

CudaFacts QueryCudaFacts() {
  CudaFacts facts;
  facts.no_gpu_reason = kNoCuda;
  return facts;
}

absl::StatusOr<DeviceMemoryInfo> QueryDeviceMemory(int index) {
  return absl::FailedPreconditionError(kNoCuda);
}

}  // namespace tally
