// DeviceQuery: what the CUDA runtime and NCCL say about this host's GPUs, for
// GetServerInfo, /metrics and memory admission. Plain C++ (no LibTorch, no
// CUDA headers): runtime/cuda/device_query.cc answers through the CUDA runtime
// API when the build has the CUDA pieces (TALLY_CUDA_ENABLED), and
// runtime/parallel/device_query_stub.cc answers "no CUDA in this build"
// otherwise. Nothing here fails or crashes on a machine without a driver or a
// GPU: the facts then list no GPU and say why.
//
//   const tally::CudaFacts facts = tally::QueryCudaFacts();
//   for (const tally::GpuFacts& gpu : facts.gpus) { ... gpu.name ... }
//   absl::StatusOr<tally::DeviceMemoryInfo> memory =
//       tally::QueryDeviceMemory(/*index=*/0);  // free and total bytes
#ifndef TALLY_RUNTIME_PARALLEL_DEVICE_QUERY_H_
#define TALLY_RUNTIME_PARALLEL_DEVICE_QUERY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tally {

struct GpuFacts {
  int index = 0;  // the CUDA runtime's (CUDA_VISIBLE_DEVICES applied)
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int64_t total_memory_bytes = 0;
};

struct CudaFacts {
  // False when this build has no CUDA pieces (then everything below is empty).
  bool built_with_cuda = false;
  // Versions as "major.minor" ("major.minor.patch" for NCCL); empty when
  // unknown (no driver, no NCCL library).
  std::string driver_version;
  std::string runtime_version;
  std::string nccl_version;
  std::vector<GpuFacts> gpus;
  // Why `gpus` is empty: the CUDA runtime's error ("no CUDA-capable device is
  // detected", "CUDA driver version is insufficient ..."), or why there is no
  // CUDA at all; empty when there are GPUs.
  std::string no_gpu_reason;
};

// Never fails: errors of the CUDA runtime become an empty `gpus` and a
// `no_gpu_reason`.
CudaFacts QueryCudaFacts();

struct DeviceMemoryInfo {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};

// cudaMemGetInfo of GPU `index`, which becomes the calling thread's current
// device (call it only for the device the thread works on, never to look at
// another rank's: that would create a CUDA context there).
// FAILED_PRECONDITION without CUDA or on the runtime's error.
absl::StatusOr<DeviceMemoryInfo> QueryDeviceMemory(int index);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_DEVICE_QUERY_H_
