// A rank's device: --device parsed, the device chosen from injected GPU
// counts (every refusal and its message), what this CPU machine reports, and
// the device facts GetServerInfo and /metrics show.
#include "runtime/parallel/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <string>

#include "runtime/parallel/device_query.h"
#include "server/device_metrics.h"
#include "server/server_info.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

TEST(DeviceKindTest, ParsesItsNamesAndRefusesOthers) {
  for (DeviceKind kind :
       {DeviceKind::kAuto, DeviceKind::kCpu, DeviceKind::kCuda}) {
    absl::StatusOr<DeviceKind> parsed = ParseDeviceKind(DeviceKindName(kind));
    ASSERT_TRUE(parsed.ok()) << DeviceKindName(kind);
    EXPECT_EQ(*parsed, kind);
  }
  const absl::StatusOr<DeviceKind> gpu = ParseDeviceKind("gpu");
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(gpu.status().message(), HasSubstr("--device"));
  EXPECT_THAT(gpu.status().message(), HasSubstr("'gpu'"));
}

GpuAvailability Gpus(int count) {
  GpuAvailability gpus;
  gpus.visible_gpus = count;
  if (count == 0) gpus.unavailable_reason = "no driver here";
  return gpus;
}

TEST(ResolveDeviceTest, LocalRankTakesItsGpu) {
  for (DeviceKind kind : {DeviceKind::kAuto, DeviceKind::kCuda}) {
    absl::StatusOr<RankDevice> chosen = ResolveDevice(kind, 3, 8, Gpus(8));
    ASSERT_TRUE(chosen.ok()) << chosen.status();
    EXPECT_EQ(chosen->device, torch::Device(torch::kCUDA, 3));
    EXPECT_THAT(chosen->why, HasSubstr("local rank 3 of 8, 8 GPUs visible"));
  }
}

TEST(ResolveDeviceTest, CpuWhenAskedOrWithoutGpu) {
  absl::StatusOr<RankDevice> asked =
      ResolveDevice(DeviceKind::kCpu, 0, 1, Gpus(8));
  ASSERT_TRUE(asked.ok());
  EXPECT_EQ(asked->device, torch::Device(torch::kCPU));
  EXPECT_EQ(asked->why, "--device cpu");
  absl::StatusOr<RankDevice> none =
      ResolveDevice(DeviceKind::kAuto, 0, 1, Gpus(0));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->device, torch::Device(torch::kCPU));
  EXPECT_THAT(none->why, HasSubstr("no driver here"));
}

TEST(ResolveDeviceTest, CudaWithoutGpuIsRefusedWithTheReason) {
  const absl::StatusOr<RankDevice> chosen =
      ResolveDevice(DeviceKind::kCuda, 0, 1, Gpus(0));
  EXPECT_EQ(chosen.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(chosen.status().message(), HasSubstr("--device cuda"));
  EXPECT_THAT(chosen.status().message(), HasSubstr("no driver here"));
}

TEST(ResolveDeviceTest, MoreLocalRanksThanGpusIsRefused) {
  for (DeviceKind kind : {DeviceKind::kAuto, DeviceKind::kCuda}) {
    const absl::StatusOr<RankDevice> chosen =
        ResolveDevice(kind, 0, 4, Gpus(2));
    EXPECT_EQ(chosen.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(chosen.status().message(),
                HasSubstr(absl::StrCat("--device ", DeviceKindName(kind))));
    EXPECT_THAT(chosen.status().message(),
                HasSubstr("4 local ranks but this process sees 2 GPUs"));
  }
  // A local rank past the launcher's count needs its GPU too.
  const absl::StatusOr<RankDevice> past =
      ResolveDevice(DeviceKind::kCuda, 2, 1, Gpus(2));
  EXPECT_THAT(past.status().message(), HasSubstr("3 local ranks"));
  // The CPU needs no GPU per rank.
  EXPECT_TRUE(ResolveDevice(DeviceKind::kCpu, 0, 4, Gpus(2)).ok());
}

// Without a usable GPU (this build's LibTorch, or no driver) auto is cpu and
// says why; the CUDA runtime's facts list no GPU and say why, never crash.
TEST(DetectGpusTest, NoGpuHereSaysWhy) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is visible";
  const GpuAvailability gpus = DetectGpus();
  EXPECT_EQ(gpus.visible_gpus, 0);
  EXPECT_FALSE(gpus.unavailable_reason.empty());
  const CudaFacts facts = QueryCudaFacts();
  if (facts.gpus.empty()) EXPECT_FALSE(facts.no_gpu_reason.empty());
  EXPECT_FALSE(QueryDeviceMemory(0).ok());
  EXPECT_EQ(CachingAllocatorBytes(torch::Device(torch::kCUDA, 0)).reserved, 0);
}

TEST(DescribeDevicesTest, ListsTheGpusAndTheRanksDevice) {
  CudaFacts facts;
  facts.built_with_cuda = true;
  facts.driver_version = "13.0";
  facts.runtime_version = "13.0";
  facts.nccl_version = "2.27.7";
  facts.gpus.push_back({0, "NVIDIA H100 80GB HBM3", 9, 0, int64_t{85} << 30});
  facts.gpus.push_back({1, "NVIDIA H100 80GB HBM3", 9, 0, int64_t{85} << 30});
  const v1::ServerInfo::Devices devices = DescribeDevices(
      {torch::Device(torch::kCUDA, 1), "--device auto: local rank 1 of 2"},
      /*allow_tf32=*/true, facts);
  EXPECT_EQ(devices.device(), "cuda:1");
  EXPECT_EQ(devices.reason(), "--device auto: local rank 1 of 2");
  EXPECT_EQ(devices.cuda_driver_version(), "13.0");
  EXPECT_EQ(devices.nccl_version(), "2.27.7");
  ASSERT_EQ(devices.gpus_size(), 2);
  EXPECT_EQ(devices.gpus(1).index(), 1);
  EXPECT_EQ(devices.gpus(1).name(), "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(devices.gpus(1).compute_capability(), "9.0");
  EXPECT_EQ(devices.gpus(1).total_memory_bytes(), int64_t{85} << 30);
  EXPECT_TRUE(devices.no_gpu_reason().empty());
  EXPECT_TRUE(devices.allow_tf32());

  CudaFacts none;
  none.no_gpu_reason = "no CUDA pieces";
  const v1::ServerInfo::Devices cpu =
      DescribeDevices({torch::kCPU, "--device auto: no GPU: no CUDA pieces"},
                      /*allow_tf32=*/false, none);
  EXPECT_EQ(cpu.device(), "cpu");
  EXPECT_EQ(cpu.gpus_size(), 0);
  EXPECT_EQ(cpu.no_gpu_reason(), "no CUDA pieces");
}

// The four gauges exist per device with the rank's labels; without a GPU to
// read they stay 0 instead of failing.
TEST(DeviceMemoryGaugesTest, RegistersTheGaugesOfTheDevice) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is visible";
  prometheus::Registry registry;
  DeviceMemoryGauges gauges(registry, {{"rank", "2"}},
                            torch::Device(torch::kCUDA, 1));
  gauges.Update();
  const std::string text =
      prometheus::TextSerializer().Serialize(registry.Collect());
  for (const char* name :
       {"tally_device_memory_free_bytes", "tally_device_memory_total_bytes",
        "tally_device_memory_reserved_bytes",
        "tally_device_memory_allocated_bytes"}) {
    EXPECT_THAT(
        text, HasSubstr(absl::StrCat(name, "{rank=\"2\",device=\"cuda:1\"} 0")))
        << text;
  }
}

}  // namespace
}  // namespace tally
