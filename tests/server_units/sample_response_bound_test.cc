#include <cstdint>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/response_bound.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

constexpr int32_t kLargestToken = std::numeric_limits<int32_t>::max();

void AddPrompt(v1::TokenSequence* prompt, const std::vector<int32_t>& tokens) {
  prompt->mutable_tokens()->Add(tokens.begin(), tokens.end());
}

v1::SampleRequest TwoPrompts() {
  v1::SampleRequest request;
  request.set_model_id("m");
  AddPrompt(request.add_prompts(), {1, 2, 3});
  AddPrompt(request.add_prompts(), {1, 2, 3, 4, 5});
  request.set_num_samples(3);
  request.mutable_params()->set_max_tokens(7);
  return request;
}

// The prompt log-probabilities of `prompt` at their widest: every position
// with `topk` entries of the largest token id.
void FillPromptLogprobs(const v1::TokenSequence& prompt, int topk,
                        v1::PromptLogprobs* out) {
  for (int i = 1; i < prompt.tokens_size(); ++i) {
    out->add_logprobs(-1.25);
    if (topk == 0) continue;
    v1::TopkLogprobs* entry = out->add_topk();
    for (int k = 0; k < topk; ++k) {
      entry->add_tokens(kLargestToken);
      entry->add_logprobs(-0.5);
    }
  }
}

// The largest response the server can send to `request`.
v1::SampleResponse WidestResponse(const v1::SampleRequest& request) {
  v1::SampleResponse response;
  for (const v1::TokenSequence& prompt : request.prompts()) {
    for (int s = 0; s < request.num_samples(); ++s) {
      v1::SampledSequence* sequence = response.add_sequences();
      for (int t = 0; t < request.params().max_tokens(); ++t) {
        sequence->add_tokens(kLargestToken);
        sequence->add_logprobs(-3.5);
      }
      sequence->set_stop_reason(v1::STOP_REASON_STOP);
    }
    if (request.include_prompt_logprobs() ||
        request.topk_prompt_logprobs() > 0) {
      FillPromptLogprobs(prompt, request.topk_prompt_logprobs(),
                         response.add_prompt_logprobs());
    }
  }
  response.set_seed(std::numeric_limits<uint64_t>::max());
  response.set_step(std::numeric_limits<int64_t>::max());
  return response;
}

TEST(SampleResponseBoundTest, BoundsTheWidestResponseClosely) {
  for (int topk : {0, 4}) {
    for (bool include : {false, true}) {
      v1::SampleRequest request = TwoPrompts();
      request.set_include_prompt_logprobs(include);
      request.set_topk_prompt_logprobs(topk);
      const auto widest =
          static_cast<int64_t>(WidestResponse(request).ByteSizeLong());
      const int64_t bound = SampleResponseBound(request);
      EXPECT_GE(bound, widest) << "topk " << topk << " include " << include;
      EXPECT_LE(bound, widest * 3 / 2)
          << "topk " << topk << " include " << include;
    }
  }
}

TEST(SampleResponseBoundTest, RefusesAResponseOverTheLimitNamingTheFields) {
  v1::SampleRequest request = TwoPrompts();
  request.set_topk_prompt_logprobs(4);
  const int64_t bound = SampleResponseBound(request);
  EXPECT_TRUE(CheckSampleResponseFits(request, bound).ok());
  EXPECT_TRUE(CheckSampleResponseFits(request, /*no limit=*/0).ok());
  const absl::Status refused = CheckSampleResponseFits(request, bound - 1);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("--max-message-bytes"));
  EXPECT_THAT(refused.message(), HasSubstr("params.max_tokens"));
  EXPECT_THAT(refused.message(), HasSubstr("topk_prompt_logprobs"));
  EXPECT_THAT(refused.message(), HasSubstr("nothing was executed"));
}

TEST(SampleResponseBoundTest, SaturatesOnHostileFields) {
  v1::SampleRequest request = TwoPrompts();
  request.set_num_samples(std::numeric_limits<int32_t>::max());
  request.mutable_params()->set_max_tokens(std::numeric_limits<int32_t>::max());
  EXPECT_GT(SampleResponseBound(request), int64_t{1} << 62);
  EXPECT_EQ(CheckSampleResponseFits(request, int64_t{1} << 31).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(ComputeLogprobsResponseBoundTest, BoundsTheWidestResponseAndRefuses) {
  v1::ComputeLogprobsRequest request;
  request.set_model_id("m");
  AddPrompt(request.add_prompts(), {1, 2, 3, 4});
  AddPrompt(request.add_prompts(), {1});
  request.set_topk(5);
  v1::ComputeLogprobsResponse widest;
  for (const v1::TokenSequence& prompt : request.prompts()) {
    FillPromptLogprobs(prompt, request.topk(), widest.add_prompts());
  }
  widest.set_step(std::numeric_limits<int64_t>::max());
  const int64_t bound = ComputeLogprobsResponseBound(request);
  EXPECT_GE(bound, static_cast<int64_t>(widest.ByteSizeLong()));
  EXPECT_LE(bound, static_cast<int64_t>(widest.ByteSizeLong()) * 3 / 2);
  const absl::Status refused =
      CheckComputeLogprobsResponseFits(request, bound - 1);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("topk"));
  EXPECT_TRUE(CheckComputeLogprobsResponseFits(request, bound).ok());
}

}  // namespace
}  // namespace tally
