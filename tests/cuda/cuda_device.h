// Whether the CUDA tests of this machine can run: tests that need a device
// report themselves skipped, with the reason, instead of passing.
//
//   if (auto reason = tally::testing::MissingCudaDevice()) {
//     GTEST_SKIP() << *reason;
//   }
#ifndef TALLY_TESTS_CUDA_CUDA_DEVICE_H_
#define TALLY_TESTS_CUDA_CUDA_DEVICE_H_

#include <cuda_runtime_api.h>

#include <optional>
#include <string>

namespace tally::testing {

// Why no CUDA device is usable, or nullopt when one is.
inline std::optional<std::string> MissingCudaDevice() {
  int device_count = 0;
  const cudaError_t error = cudaGetDeviceCount(&device_count);
  if (error != cudaSuccess) {
    return std::string("no usable CUDA device: ") + cudaGetErrorString(error);
  }
  if (device_count == 0) {
    return std::string("no CUDA device: cudaGetDeviceCount returned 0");
  }
  return std::nullopt;
}

}  // namespace tally::testing

#endif  // TALLY_TESTS_CUDA_CUDA_DEVICE_H_
