// The device a rank computes on, chosen once at start from --device, the
// rank's place on its host and the GPUs this process sees; and what the
// device's memory holds (for /metrics and memory admission).
//
// Local rank r takes GPU r of those visible (CUDA_VISIBLE_DEVICES applies,
// through the CUDA runtime's numbering). kAuto takes cuda when a GPU is
// usable, cpu otherwise; kCuda without a usable GPU, or with fewer GPUs than
// local ranks, is refused with the reason.
//
//   TALLY_ASSIGN_OR_RETURN(tally::DeviceKind kind,
//                          tally::ParseDeviceKind("auto"));
//   TALLY_ASSIGN_OR_RETURN(
//       tally::RankDevice chosen,
//       tally::ResolveDevice(kind, env.local_rank, local_ranks,
//                            tally::DetectGpus()));
//   engine_options.device = chosen.device;  // chosen.why says why
#ifndef TALLY_RUNTIME_PARALLEL_DEVICE_H_
#define TALLY_RUNTIME_PARALLEL_DEVICE_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

enum class DeviceKind { kAuto, kCpu, kCuda };

// "auto", "cpu" or "cuda"; INVALID_ARGUMENT naming --device otherwise.
absl::StatusOr<DeviceKind> ParseDeviceKind(absl::string_view text);
const char* DeviceKindName(DeviceKind kind);

// The GPUs LibTorch can place tensors on.
struct GpuAvailability {
  int visible_gpus = 0;
  // Why there is none to use, when visible_gpus is 0: no CUDA in this
  // LibTorch, no CUDA pieces in this build, or none visible (with the CUDA
  // runtime's error).
  std::string unavailable_reason;
};

// Asks LibTorch (torch::cuda) and the CUDA runtime
// (runtime/parallel/device_query.h).
GpuAvailability DetectGpus();

struct RankDevice {
  torch::Device device{torch::kCPU};
  // Why this device: "--device cuda", "--device auto: 8 GPUs visible", or
  // why not a GPU.
  std::string why;
};

// Pure: the device of local rank `local_rank` (>= 0) of `local_ranks` on its
// host given `gpus`. FAILED_PRECONDITION naming --device when kCuda has no
// GPU, or when a GPU is wanted (kCuda, or kAuto with GPUs visible) and the
// host runs more local ranks than it sees GPUs (local_rank + 1 at least).
absl::StatusOr<RankDevice> ResolveDevice(DeviceKind kind, int local_rank,
                                         int local_ranks,
                                         const GpuAvailability& gpus);

// What the CUDA caching allocator holds on `device`: reserved (cached,
// used or not) and allocated (in live tensors) bytes. Zeros on the CPU, with
// a LibTorch without CUDA, and before LibTorch first used CUDA.
struct AllocatorBytes {
  int64_t reserved = 0;
  int64_t allocated = 0;
};
AllocatorBytes CachingAllocatorBytes(const torch::Device& device);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_DEVICE_H_
