// DeviceMemoryGauges: /metrics' view of the memory of the device a rank
// computes on, for a CUDA rank (a CPU rank has none):
// tally_device_memory_{free,total,reserved,allocated}_bytes{device="cuda:0"},
// free and total as the CUDA runtime reports them, reserved and allocated as
// LibTorch's caching allocator holds them (docs/metrics.md).
//
//   tally::DeviceMemoryGauges gauges(*registry, {{"rank", "0"}}, device);
//   gauges.Update();  // on the thread that computes on `device`
#ifndef TALLY_SERVER_DEVICE_METRICS_H_
#define TALLY_SERVER_DEVICE_METRICS_H_

#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <torch/torch.h>

namespace tally {

class DeviceMemoryGauges {
 public:
  // Registers the gauges in `registry` (which outlives this) with `labels`
  // (the rank's) and device="<device>".
  DeviceMemoryGauges(prometheus::Registry& registry,
                     const prometheus::Labels& labels,
                     const torch::Device& device);

  // Reads the device (QueryDeviceMemory, CachingAllocatorBytes) and sets the
  // gauges; a failed read of the CUDA runtime leaves free and total as they
  // were.
  void Update();

 private:
  torch::Device device_;
  prometheus::Gauge* free_;
  prometheus::Gauge* total_;
  prometheus::Gauge* reserved_;
  prometheus::Gauge* allocated_;
};

}  // namespace tally

#endif  // TALLY_SERVER_DEVICE_METRICS_H_
