// ForwardBackwardResponseBound against real serialization: for requests of
// many shapes, the largest response the engine can produce (every varint at
// its longest, every sample, logprob, token loss and policy statistic
// present, the engine's metric names
// for a dense or MoE model) never exceeds the bound, and the bound stays
// close to it.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "server/convert.h"

namespace tally {
namespace {

v1::ForwardBackwardRequest Request(int samples, int length, bool logprobs) {
  v1::ForwardBackwardRequest request;
  request.set_model_id("m");
  request.set_return_logprobs(logprobs);
  for (int s = 0; s < samples; ++s) {
    v1::Sample* sample = request.add_samples();
    for (int t = 0; t < length + s; ++t) {
      sample->add_input_tokens(t);
      sample->add_target_tokens(t);
    }
  }
  return request;
}

// Statistics whose every field is set, the count at its longest varint.
PolicyStats LargestPolicyStats() {
  PolicyStats stats;
  stats.tokens = -1;
  for (double* value : {&stats.ratio_mean, &stats.ratio_min, &stats.ratio_max,
                        &stats.clipped_fraction, &stats.logprob_gap_mean,
                        &stats.logprob_gap_max, &stats.kl_k1, &stats.kl_k3}) {
    *value = 0.5;
  }
  return stats;
}

// The largest response to `request`: negative int64s take 10 bytes; every
// sample's logprobs and token losses (return_logprobs) and policy
// statistics, and the call's.
v1::ForwardBackwardResponse LargestResponse(
    const v1::ForwardBackwardRequest& request, int64_t experts) {
  ForwardBackwardResult result;
  result.loss_sum = result.loss_mean = std::numeric_limits<double>::max();
  result.valid_tokens = result.num_samples = -1;
  result.window = {-1, -1, -1, std::nullopt};
  for (const v1::Sample& sample : request.samples()) {
    SampleResult s;
    s.loss_sum = -1;
    s.valid_tokens = -1;
    if (request.return_logprobs()) {
      s.logprobs.assign(sample.input_tokens_size(), -1.5);
      s.token_losses.assign(sample.input_tokens_size(), 1.5);
    }
    s.policy = LargestPolicyStats();
    result.samples.push_back(s);
  }
  result.policy = LargestPolicyStats();
  for (const char* name : {"micro_batches", "padded_tokens", "seconds"}) {
    result.metrics[name] = 1;
  }
  if (experts > 0) {
    for (int64_t e = 0; e < experts; ++e) {
      result.metrics[absl::StrCat("expert_tokens_", e)] = 1;
    }
    result.metrics["expert_load_min_fraction"] = 1;
    result.metrics["expert_load_max_fraction"] = 1;
  }
  v1::ForwardBackwardResponse response;
  ToProto(result, &response);
  return response;
}

TEST(ResponseBoundTest, BoundsTheLargestResponseClosely) {
  for (int samples : {0, 1, 3, 40}) {
    for (int length : {1, 17, 300, 5000}) {
      for (bool logprobs : {false, true}) {
        for (int64_t experts : {0, 8, 64}) {
          const v1::ForwardBackwardRequest request =
              Request(samples, length, logprobs);
          const int64_t actual = static_cast<int64_t>(
              LargestResponse(request, experts).ByteSizeLong());
          const int64_t bound = ForwardBackwardResponseBound(request, experts);
          const std::string shape =
              absl::StrCat(samples, " samples of ", length, "+ tokens, ",
                           logprobs ? "logprobs, " : "", experts, " experts");
          EXPECT_GE(bound, actual) << shape;
          EXPECT_LE(bound, actual + actual / 2 + 512) << shape;
        }
      }
    }
  }
}

}  // namespace
}  // namespace tally
