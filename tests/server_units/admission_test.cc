// MemoryAdmission's ledger: models hold their bytes until removed, against
// the limit and their tenant's quota; a call must fit beside them. A CUDA
// rank's limit from its device's memory. And the estimates scale as they
// should with a hostile config.
#include "server/admission.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/config/memory_estimate.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

MemoryAdmissionOptions Limits(double limit_bytes, double per_tenant_bytes) {
  MemoryAdmissionOptions options;
  options.limit_bytes = limit_bytes;
  options.per_tenant_bytes = per_tenant_bytes;
  return options;
}

TEST(MemoryAdmissionTest, ModelsHoldTheirBytesAgainstTheLimitAndQuota) {
  MemoryAdmission admission(Limits(100, 60));
  EXPECT_TRUE(admission.CheckModel("alice", 50).ok());
  admission.Add("alice/a", "alice", 50);
  const absl::Status quota = admission.CheckModel("alice", 20);
  EXPECT_EQ(quota.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(quota.message(), HasSubstr("--max-memory-bytes-per-tenant"));
  EXPECT_TRUE(admission.CheckModel("bob", 45).ok());
  admission.Add("bob/b", "bob", 45);
  const absl::Status full = admission.CheckModel("carol", 10);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("of --max-memory-bytes are left"));
  EXPECT_TRUE(admission.CheckCall(5).ok());
  const absl::Status call = admission.CheckCall(6);
  EXPECT_EQ(call.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(call.message(), HasSubstr("nothing was executed"));
  admission.Remove("alice/a");
  EXPECT_EQ(admission.resident_bytes(), 45);
  EXPECT_TRUE(admission.CheckModel("alice", 55).ok());
  EXPECT_TRUE(admission.CheckCall(55).ok());
  // Without a limit nothing is refused.
  MemoryAdmission unlimited(Limits(0, 0));
  EXPECT_TRUE(unlimited.CheckModel("", 1e30).ok());
  EXPECT_TRUE(unlimited.CheckCall(1e30).ok());
}

// The observers see every change of the total and every refusal, by kind;
// an admitted model or call is no refusal.
TEST(MemoryAdmissionTest, ObserversSeeTheTotalAndEachRefusal) {
  std::vector<double> totals;
  std::vector<std::string> refusals;
  MemoryAdmissionOptions options = Limits(100, 0);
  options.on_resident = [&](double bytes) { totals.push_back(bytes); };
  options.on_refusal = [&](const char* what) { refusals.push_back(what); };
  MemoryAdmission admission(options);
  ASSERT_TRUE(admission.CheckModel("", 70).ok());
  admission.Add("a", "", 70);
  EXPECT_FALSE(admission.CheckModel("", 40).ok());
  EXPECT_TRUE(admission.CheckCall(30).ok());
  EXPECT_FALSE(admission.CheckCall(31).ok());
  admission.Add("b", "", 20);
  admission.Remove("a");
  admission.Remove("missing");  // changes nothing, tells nothing
  EXPECT_EQ(totals, (std::vector<double>{70, 90, 20}));
  EXPECT_EQ(refusals, (std::vector<std::string>{"model", "call"}));
}

constexpr double kGib = 1024.0 * 1024 * 1024;

// free + (reserved - allocated) - max(1 GiB, 5% of the total).
TEST(DeviceMemoryLimitTest, FreeAtStartPlusCachedLessTheMargin) {
  // An 80 GiB GPU: the margin is 5% (4 GiB); 6 - 2 GiB cached unused.
  const MemoryLimit big =
      DeviceMemoryLimit({"cuda:3", 70 * kGib, 80 * kGib, 6 * kGib, 2 * kGib},
                        /*flag_bytes=*/0);
  EXPECT_DOUBLE_EQ(big.bytes, 70 * kGib);
  EXPECT_THAT(big.name, HasSubstr("cuda:3's memory"));
  EXPECT_THAT(big.name, HasSubstr("70 GiB free at start + 4 GiB cached"));
  EXPECT_THAT(big.name, HasSubstr("4 GiB margin, of 80 GiB"));
  // A 10 GiB GPU: the margin is the 1 GiB floor; nothing cached.
  EXPECT_DOUBLE_EQ(
      DeviceMemoryLimit({"cuda:0", 5 * kGib, 10 * kGib, 0, 0}, 0).bytes,
      4 * kGib);
  // Less free than the margin leaves nothing, never a negative limit;
  // allocated above reserved (stats read at different times) caches nothing.
  EXPECT_DOUBLE_EQ(DeviceMemoryLimit(
                       {"cuda:0", 0.5 * kGib, 10 * kGib, 1 * kGib, 3 * kGib}, 0)
                       .bytes,
                   0);
}

TEST(DeviceMemoryLimitTest, ALowerMaxMemoryBytesWins) {
  const DeviceMemorySnapshot memory{"cuda:0", 20 * kGib, 40 * kGib, 0, 0};
  const MemoryLimit lower =
      DeviceMemoryLimit(memory, static_cast<int64_t>(8 * kGib));
  EXPECT_DOUBLE_EQ(lower.bytes, 8 * kGib);
  EXPECT_EQ(lower.name, "--max-memory-bytes");
  const MemoryLimit higher =
      DeviceMemoryLimit(memory, static_cast<int64_t>(30 * kGib));
  EXPECT_DOUBLE_EQ(higher.bytes, 18 * kGib);
  EXPECT_THAT(higher.name, HasSubstr("cuda:0's memory"));
}

// A refusal names the limit it ran into: the device and its numbers.
TEST(DeviceMemoryLimitTest, RefusalsNameTheDevice) {
  const MemoryLimit limit =
      DeviceMemoryLimit({"cuda:1", 11 * kGib, 20 * kGib, 0, 0}, 0);
  MemoryAdmissionOptions options = Limits(limit.bytes, 0);
  options.limit_name = limit.name;
  MemoryAdmission admission(options);
  const absl::Status model = admission.CheckModel("", 11 * kGib);
  EXPECT_EQ(model.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(model.message(),
              HasSubstr("10 GiB of cuda:1's memory (11 GiB free at start"));
  const absl::Status call = admission.CheckCall(10.5 * kGib);
  EXPECT_EQ(call.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(call.message(), HasSubstr("of cuda:1's memory"));
}

TEST(MemoryEstimateTest, HostileSizesDoNotWrapAround) {
  LlamaConfig config = LlamaConfig::EmbeddedDefault().WithDefaults();
  const double small =
      ModelResidentBytes(config, DType::kFloat32, OptimizerKind::kAdamW, 1);
  config.hidden_size = int64_t{1} << 31;
  config.intermediate_size = int64_t{1} << 33;
  config.num_hidden_layers = int64_t{1} << 20;
  const double huge =
      ModelResidentBytes(config, DType::kFloat32, OptimizerKind::kAdamW, 1);
  EXPECT_GT(huge, 1e26);  // a uint64 product would have wrapped
  EXPECT_GT(huge, small);
  // Activations grow with the micro-batch and quadratically with length.
  const LlamaConfig demo = LlamaConfig::EmbeddedDefault().WithDefaults();
  const double one = CallActivationBytes(demo, DType::kFloat32, {100}, 16384);
  EXPECT_GT(CallActivationBytes(demo, DType::kFloat32, {100, 100}, 16384), one);
  EXPECT_EQ(CallActivationBytes(demo, DType::kFloat32, {100, 100}, 100), one);
  EXPECT_GT(CallActivationBytes(demo, DType::kFloat32, {200}, 16384), 2 * one);
  EXPECT_EQ(CallActivationBytes(demo, DType::kFloat32, {}, 16384), 0);
}

}  // namespace
}  // namespace tally
