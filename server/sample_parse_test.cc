// ParseSample and ParseComputeLogprobs: the defaults of absent fields, a
// refusal naming each field a request alone shows to be wrong, and the token
// bound --max-tokens-per-call applies to a Sample.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "server/convert.h"

namespace tally {
namespace {

v1::SampleRequest ValidRequest() {
  v1::SampleRequest request;
  request.set_model_id("m");
  for (const std::vector<int>& prompt : {std::vector<int>{1, 2, 3}, {4}}) {
    request.add_prompts()->mutable_tokens()->Add(prompt.begin(), prompt.end());
  }
  request.mutable_params()->set_max_tokens(5);
  return request;
}

TEST(ParseSampleTest, AbsentFieldsTakeTheirDefaults) {
  const absl::StatusOr<SampleArgs> args = ParseSample(ValidRequest());
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(args->prompts, (std::vector<TokenIds>{{1, 2, 3}, {4}}));
  EXPECT_EQ(args->num_samples, 1);
  EXPECT_EQ(args->max_tokens, 5);
  EXPECT_EQ(args->sampling.temperature, 1.0);
  EXPECT_EQ(args->sampling.top_p, 1.0);
  EXPECT_EQ(args->sampling.top_k, -1);
  EXPECT_FALSE(args->seed.has_value());
  EXPECT_FALSE(args->stop.has_value());
  EXPECT_FALSE(args->include_prompt_logprobs);
  EXPECT_EQ(args->topk_prompt_logprobs, 0);
}

TEST(ParseSampleTest, PresentFieldsAreTakenAsGiven) {
  v1::SampleRequest request = ValidRequest();
  request.set_num_samples(3);
  v1::SamplingParams& params = *request.mutable_params();
  params.set_temperature(0);
  params.set_top_p(0.5);
  params.set_top_k(7);
  params.set_seed(0);
  params.mutable_stop()->add_token_ids(2);
  params.mutable_stop()->add_sequences()->add_tokens(9);
  request.set_include_prompt_logprobs(true);
  request.set_topk_prompt_logprobs(4);
  const absl::StatusOr<SampleArgs> args = ParseSample(request);
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(args->num_samples, 3);
  EXPECT_EQ(args->sampling.temperature, 0.0);
  EXPECT_EQ(args->sampling.top_p, 0.5);
  EXPECT_EQ(args->sampling.top_k, 7);
  EXPECT_EQ(args->seed, 0u);
  ASSERT_TRUE(args->stop.has_value());
  EXPECT_EQ(args->stop->token_ids, TokenIds{2});
  EXPECT_EQ(args->stop->sequences, std::vector<TokenIds>{{9}});
  EXPECT_TRUE(args->include_prompt_logprobs);
  EXPECT_EQ(args->topk_prompt_logprobs, 4);

  // An empty stop is present: no stop condition at all, not the EOS tokens.
  request.mutable_params()->mutable_stop()->Clear();
  const absl::StatusOr<SampleArgs> none = ParseSample(request);
  ASSERT_TRUE(none.ok()) << none.status();
  ASSERT_TRUE(none->stop.has_value());
  EXPECT_TRUE(none->stop->token_ids.empty());
  EXPECT_TRUE(none->stop->sequences.empty());
}

TEST(ParseSampleTest, RefusesEachBadFieldByName) {
  struct Case {
    const char* field;
    std::function<void(v1::SampleRequest&)> spoil;
  };
  const Case cases[] = {
      {"prompts is empty", [](auto& r) { r.clear_prompts(); }},
      {"prompts[1].tokens is empty",
       [](auto& r) { r.mutable_prompts(1)->clear_tokens(); }},
      {"prompts[0].tokens[2] = -1",
       [](auto& r) { r.mutable_prompts(0)->set_tokens(2, -1); }},
      {"num_samples", [](auto& r) { r.set_num_samples(-1); }},
      {"params.max_tokens",
       [](auto& r) { r.mutable_params()->set_max_tokens(0); }},
      {"params.temperature",
       [](auto& r) { r.mutable_params()->set_temperature(-0.5); }},
      {"params.temperature",
       [](auto& r) { r.mutable_params()->set_temperature(NAN); }},
      {"params.top_p", [](auto& r) { r.mutable_params()->set_top_p(0); }},
      {"params.top_p", [](auto& r) { r.mutable_params()->set_top_p(1.5); }},
      {"params.top_k", [](auto& r) { r.mutable_params()->set_top_k(0); }},
      {"params.top_k", [](auto& r) { r.mutable_params()->set_top_k(-2); }},
      {"params.stop.token_ids[1] = -3",
       [](auto& r) {
         r.mutable_params()->mutable_stop()->add_token_ids(2);
         r.mutable_params()->mutable_stop()->add_token_ids(-3);
       }},
      {"params.stop.sequences[1].tokens is empty",
       [](auto& r) {
         r.mutable_params()->mutable_stop()->add_sequences()->add_tokens(1);
         r.mutable_params()->mutable_stop()->add_sequences();
       }},
      {"params.stop.sequences[0].tokens[0] = -1",
       [](auto& r) {
         r.mutable_params()->mutable_stop()->add_sequences()->add_tokens(-1);
       }},
      {"topk_prompt_logprobs", [](auto& r) { r.set_topk_prompt_logprobs(-1); }},
  };
  for (const Case& c : cases) {
    v1::SampleRequest request = ValidRequest();
    c.spoil(request);
    const absl::Status status = ParseSample(request).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
        << c.field << ": " << status;
    EXPECT_TRUE(absl::StrContains(status.message(), c.field))
        << c.field << ": " << status;
  }
}

TEST(ParseComputeLogprobsTest, RefusesEachBadFieldByName) {
  v1::ComputeLogprobsRequest request;
  request.set_model_id("m");
  request.add_prompts()->add_tokens(3);
  request.set_topk(2);
  const absl::StatusOr<LogprobsArgs> args = ParseComputeLogprobs(request);
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(args->prompts, std::vector<TokenIds>{{3}});
  EXPECT_EQ(args->topk, 2);

  v1::ComputeLogprobsRequest bad = request;
  bad.set_topk(-1);
  EXPECT_TRUE(
      absl::StrContains(ParseComputeLogprobs(bad).status().message(), "topk"));
  bad = request;
  bad.add_prompts();
  EXPECT_TRUE(absl::StrContains(ParseComputeLogprobs(bad).status().message(),
                                "prompts[1].tokens is empty"));
  bad = request;
  bad.mutable_prompts(0)->set_tokens(0, -7);
  EXPECT_EQ(ParseComputeLogprobs(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SampleTokenBoundTest, CountsEverySequenceWithItsPromptAndMaxTokens) {
  v1::SampleRequest request = ValidRequest();  // prompts of 3 and 1 tokens
  EXPECT_EQ(SampleTokenBound(request), (3 + 5) + (1 + 5));
  request.set_num_samples(4);
  EXPECT_EQ(SampleTokenBound(request), 4 * ((3 + 5) + (1 + 5)));
  request.set_num_samples(2147483647);
  request.mutable_params()->set_max_tokens(2147483647);
  EXPECT_GT(SampleTokenBound(request), int64_t{1} << 61);  // no overflow
}

}  // namespace
}  // namespace tally
