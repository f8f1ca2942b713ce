#include "runtime/parallel/device.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/parallel/device_query.h"
#include "runtime/parallel/torch_compat.h"

#if TALLY_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace tally {

absl::StatusOr<DeviceKind> ParseDeviceKind(absl::string_view text) {
  for (DeviceKind kind :
       {DeviceKind::kAuto, DeviceKind::kCpu, DeviceKind::kCuda}) {
    if (text == DeviceKindName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device: expected auto, cpu or cuda, got '", text, "'"));
}

const char* DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto:
      return "auto";
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "auto";
}

GpuAvailability DetectGpus() {
  GpuAvailability gpus;
  if (!TALLY_TORCH_CUDA) {
    gpus.unavailable_reason =
        "this LibTorch has no CUDA (build against a CUDA PyTorch wheel's "
        "LibTorch)";
    return gpus;
  }
  const CudaFacts facts = QueryCudaFacts();
  if (!facts.built_with_cuda || facts.gpus.empty()) {
    gpus.unavailable_reason = facts.no_gpu_reason;
    return gpus;
  }
  if (!torch::cuda::is_available()) {
    gpus.unavailable_reason = "LibTorch sees no usable GPU";
    return gpus;
  }
  gpus.visible_gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus.visible_gpus == 0) {
    gpus.unavailable_reason = "LibTorch sees no GPU";
  }
  return gpus;
}

absl::StatusOr<RankDevice> ResolveDevice(DeviceKind kind, int local_rank,
                                         int local_ranks,
                                         const GpuAvailability& gpus) {
  if (kind == DeviceKind::kCpu) return RankDevice{torch::kCPU, "--device cpu"};
  if (gpus.visible_gpus == 0) {
    if (kind == DeviceKind::kAuto) {
      return RankDevice{torch::kCPU, absl::StrCat("--device auto: no GPU: ",
                                                  gpus.unavailable_reason)};
    }
    return absl::FailedPreconditionError(
        absl::StrCat("--device cuda: no GPU to use: ", gpus.unavailable_reason,
                     "; run with --device cpu or auto"));
  }
  // A local rank past the launcher's count (--local-rank without
  // LOCAL_WORLD_SIZE) needs a GPU of its own too.
  const int needed = std::max(local_ranks, local_rank + 1);
  if (needed > gpus.visible_gpus) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device ", DeviceKindName(kind), ": this host runs ", needed,
        " local ranks but this process sees ", gpus.visible_gpus,
        " GPUs (one GPU per rank; check CUDA_VISIBLE_DEVICES and "
        "--nproc-per-node), or run with --device cpu"));
  }
  return RankDevice{
      torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank)),
      absl::StrCat("--device ", DeviceKindName(kind), ": local rank ",
                   local_rank, " of ", local_ranks, ", ", gpus.visible_gpus,
                   " GPUs visible")};
}

AllocatorBytes CachingAllocatorBytes(const torch::Device& device) {
  AllocatorBytes bytes;
#if TALLY_TORCH_CUDA
  if (!device.is_cuda()) return bytes;
  // Through the allocator object, whose getDeviceStats every LibTorch 2.x
  // has (the free function's parameter type changed). Index 0 of each stat
  // array is the aggregate over the pools (StatType::AGGREGATE, whose
  // namespace moved between versions).
  // Before LibTorch's first use of CUDA the allocator knows no device and
  // throws: it holds nothing then.
  try {
    const auto stats =
        c10::cuda::CUDACachingAllocator::get()->getDeviceStats(device.index());
    bytes.reserved = stats.reserved_bytes[0].current;
    bytes.allocated = stats.allocated_bytes[0].current;
  } catch (const c10::Error&) {
  }
#endif
  return bytes;
}

}  // namespace tally
