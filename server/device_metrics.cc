#include "server/device_metrics.h"

#include <string>

#include "absl/status/statusor.h"
#include "runtime/parallel/device.h"
#include "runtime/parallel/device_query.h"

namespace tally {
namespace {

prometheus::Gauge* DeviceGauge(prometheus::Registry& registry,
                               const prometheus::Labels& labels,
                               const std::string& device, const char* name,
                               const char* help) {
  return &prometheus::BuildGauge()
              .Name(name)
              .Help(help)
              .Labels(labels)
              .Register(registry)
              .Add({{"device", device}});
}

}  // namespace

DeviceMemoryGauges::DeviceMemoryGauges(prometheus::Registry& registry,
                                       const prometheus::Labels& labels,
                                       const torch::Device& device)
    : device_(device) {
  const std::string name = device.str();
  free_ = DeviceGauge(registry, labels, name, "tally_device_memory_free_bytes",
                      "Free memory of the rank's device (cudaMemGetInfo)");
  total_ =
      DeviceGauge(registry, labels, name, "tally_device_memory_total_bytes",
                  "Total memory of the rank's device (cudaMemGetInfo)");
  reserved_ = DeviceGauge(
      registry, labels, name, "tally_device_memory_reserved_bytes",
      "Bytes LibTorch's caching allocator holds on the device, used or not");
  allocated_ =
      DeviceGauge(registry, labels, name, "tally_device_memory_allocated_bytes",
                  "Bytes of the caching allocator's memory in live tensors");
}

void DeviceMemoryGauges::Update() {
  const absl::StatusOr<DeviceMemoryInfo> memory =
      QueryDeviceMemory(device_.index());
  if (memory.ok()) {
    free_->Set(static_cast<double>(memory->free_bytes));
    total_->Set(static_cast<double>(memory->total_bytes));
  }
  const AllocatorBytes held = CachingAllocatorBytes(device_);
  reserved_->Set(static_cast<double>(held.reserved));
  allocated_->Set(static_cast<double>(held.allocated));
}

}  // namespace tally
