// Sampler snapshot requests without a server: the name checks of
// SaveWeightsForSampler and DeleteSampler and of Sample's and
// ComputeLogprobs' `sampler` (INVALID_ARGUMENT naming the field), the
// SamplerInfo a snapshot is answered with, its admission estimate, and the
// ledger refusing a snapshot that does not fit, naming the flag, and giving
// its bytes back once removed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "server/admission.h"
#include "server/convert.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

TEST(SamplerRequestsTest, NamesAreCheckedNamingTheField) {
  v1::SaveWeightsForSamplerRequest save;
  save.set_model_id("m");
  for (const std::string& bad : std::vector<std::string>{
           "", "a/b", "..", ".", "with space", std::string(129, 'x')}) {
    save.set_name(bad);
    const absl::Status status = ValidateSamplerRequest(save);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(status.message()), HasSubstr("name")) << bad;
  }
  for (const std::string& good :
       std::vector<std::string>{"step-3", "a.b_c", std::string(128, 'x')}) {
    save.set_name(good);
    EXPECT_TRUE(ValidateSamplerRequest(save).ok()) << good;
  }
  v1::DeleteSamplerRequest remove;
  remove.set_name("x/y");
  EXPECT_EQ(ValidateSamplerRequest(remove).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SamplerRequestsTest, SampleAndLogprobsCheckTheirSampler) {
  v1::SampleRequest sample;
  sample.add_prompts()->add_tokens(1);
  sample.mutable_params()->set_max_tokens(2);
  EXPECT_TRUE(ParseSample(sample).ok());  // empty: the live weights
  sample.set_sampler("step-1");
  EXPECT_TRUE(ParseSample(sample).ok());
  sample.set_sampler("../x");
  const absl::Status bad = ParseSample(sample).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("sampler '../x'"));

  v1::ComputeLogprobsRequest logprobs;
  logprobs.add_prompts()->add_tokens(1);
  logprobs.set_sampler("s");
  EXPECT_TRUE(ParseComputeLogprobs(logprobs).ok());
  logprobs.set_sampler("a b");
  EXPECT_THAT(std::string(ParseComputeLogprobs(logprobs).status().message()),
              HasSubstr("sampler"));
}

TEST(SamplerRequestsTest, InfoNamesTheClientsModelAndTheHandle) {
  SamplerSummary summary;
  summary.model_id = "alice/m";  // an engine id, scoped to its tenant
  summary.name = "s1";
  summary.step = 4;
  summary.bytes = 1024;
  summary.created = absl::FromUnixMicros(1'700'000'000'000'000);
  summary.is_adapter = true;
  v1::SamplerInfo info;
  ToProto(summary, &info);
  EXPECT_EQ(info.model_id(), "m");
  EXPECT_EQ(info.name(), "s1");
  EXPECT_EQ(info.step(), 4);
  EXPECT_EQ(info.bytes(), 1024u);
  EXPECT_EQ(info.created_unix_micros(), 1'700'000'000'000'000);
  EXPECT_TRUE(info.is_adapter());
  EXPECT_EQ(info.path(), "tally://m/samplers/s1");
}

TEST(SamplerRequestsTest, TheEstimateIsTheWeightsAsKeptPerRank) {
  ModelSummary full;
  full.dtype = DType::kBFloat16;  // float32 masters
  full.num_parameters = 1000;
  EXPECT_EQ(SamplerSnapshotBytes(full, 1, ZeroStage::kParameters), 4000);
  // dp_shard: the shard, plus the gathered copy stages 1 and 2 keep.
  EXPECT_EQ(SamplerSnapshotBytes(full, 4, ZeroStage::kParameters), 1000);
  EXPECT_EQ(SamplerSnapshotBytes(full, 4, ZeroStage::kGradients), 5000);
  EXPECT_EQ(SamplerSnapshotBytes(full, 4, ZeroStage::kOptimizerState), 5000);
  ModelSummary adapter = full;
  adapter.lora.rank = 4;
  adapter.trainable_bytes = 320;  // the adapter alone
  EXPECT_EQ(SamplerSnapshotBytes(adapter, 1, ZeroStage::kParameters), 320);
  EXPECT_EQ(SamplerSnapshotBytes(adapter, 2, ZeroStage::kParameters), 160);
}

TEST(SamplerRequestsTest, ASnapshotThatDoesNotFitIsRefusedNamingTheFlag) {
  MemoryAdmissionOptions options;
  options.limit_bytes = 100;
  options.per_tenant_bytes = 60;
  MemoryAdmission admission(options);
  admission.Add("alice/m", "alice", 50);
  const absl::Status quota = admission.CheckSnapshot("alice", 20);
  EXPECT_EQ(quota.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(quota.message()),
              HasSubstr("the sampler snapshot (its copy of the weights)"));
  EXPECT_THAT(std::string(quota.message()),
              HasSubstr("--max-memory-bytes-per-tenant"));
  EXPECT_TRUE(admission.CheckSnapshot("alice", 10).ok());
  admission.Add("sampler alice/m s", "alice", 10);
  admission.Add("bob/m", "bob", 35);
  const absl::Status full = admission.CheckSnapshot("bob", 10);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.message()), HasSubstr("--max-memory-bytes"));
  // Deleting the snapshot gives its bytes back.
  admission.Remove("sampler alice/m s");
  EXPECT_EQ(admission.resident_bytes(), 85);
  EXPECT_TRUE(admission.CheckSnapshot("bob", 10).ok());
}

}  // namespace
}  // namespace tally
