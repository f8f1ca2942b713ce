#include "server/response_bound.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/error_reason.h"

namespace tally {
namespace {

// Wire sizes: a tag is 1 byte here, a length prefix at most 5, a varint at
// most 10 (a non-negative int32 at most 5), a double 8. Sums are kept in
// double: a hostile request's int32 fields multiply past INT64_MAX.
constexpr double kWireScalar = 1 + 10;
constexpr double kWireNested = 1 + 5;
constexpr double kWirePackedField = 1 + 5;  // a packed field's tag and length
constexpr double kWireToken = 5;
constexpr double kWireDouble = 8;

// A PromptLogprobs of a prompt of `length` tokens: a log-probability per
// token after the first, and with `topk` > 0 as many TopkLogprobs of `topk`
// tokens and log-probabilities each.
double PromptLogprobsBound(int length, int topk) {
  const double positions = std::max(0, length - 1);
  double bound = kWireNested + kWirePackedField + positions * kWireDouble;
  if (topk > 0) {
    bound += positions * (kWireNested + 2 * kWirePackedField +
                          topk * (kWireToken + kWireDouble));
  }
  return bound;
}

int64_t SaturatedBound(double bound) {
  constexpr double kMax = 9e18;  // below INT64_MAX
  return static_cast<int64_t>(std::min(bound, kMax));
}

absl::Status CheckResponseFits(int64_t bound, int64_t max_message_bytes,
                               const std::string& what,
                               const std::string& fields) {
  if (max_message_bytes <= 0 || bound <= max_message_bytes) {
    return absl::OkStatus();
  }
  return ReasonError(
      ErrorReason::kMessageTooLarge,
      absl::StrCat("the response could take ", bound, " bytes (", what,
                   "), more than --max-message-bytes (", max_message_bytes,
                   ", gRPC's limit on a message); nothing was executed: lower ",
                   fields, ", split the call, or raise the limit"));
}

}  // namespace

int64_t SampleResponseBound(const v1::SampleRequest& request) {
  const double samples = std::max(1, request.num_samples());
  const double generated = std::max(0, request.params().max_tokens());
  // seed and step.
  double bound = 2 * kWireScalar;
  // Per sequence: its tokens and log-probabilities, and its stop reason.
  const double sequence = kWireNested + 2 * kWirePackedField +
                          generated * (kWireToken + kWireDouble) + kWireScalar;
  const bool prompt_logprobs =
      request.include_prompt_logprobs() || request.topk_prompt_logprobs() > 0;
  for (const v1::TokenSequence& prompt : request.prompts()) {
    bound += samples * sequence;
    if (prompt_logprobs) {
      bound += PromptLogprobsBound(prompt.tokens_size(),
                                   request.topk_prompt_logprobs());
    }
  }
  return SaturatedBound(bound);
}

int64_t ComputeLogprobsResponseBound(
    const v1::ComputeLogprobsRequest& request) {
  double bound = kWireScalar;  // step
  for (const v1::TokenSequence& prompt : request.prompts()) {
    bound += PromptLogprobsBound(prompt.tokens_size(), request.topk());
  }
  return SaturatedBound(bound);
}

absl::Status CheckSampleResponseFits(const v1::SampleRequest& request,
                                     int64_t max_message_bytes) {
  const bool prompt_logprobs =
      request.include_prompt_logprobs() || request.topk_prompt_logprobs() > 0;
  return CheckResponseFits(
      SampleResponseBound(request), max_message_bytes,
      absl::StrCat(
          request.prompts_size(), " prompts x num_samples ",
          std::max(1, request.num_samples()),
          " sequences of params.max_tokens ", request.params().max_tokens(),
          " tokens with their log-probabilities",
          prompt_logprobs ? ", and the prompts' log-probabilities" : "",
          request.topk_prompt_logprobs() > 0
              ? absl::StrCat(" with topk_prompt_logprobs ",
                             request.topk_prompt_logprobs())
              : ""),
      prompt_logprobs
          ? "params.max_tokens, num_samples, include_prompt_logprobs or "
            "topk_prompt_logprobs"
          : "params.max_tokens or num_samples");
}

absl::Status CheckComputeLogprobsResponseFits(
    const v1::ComputeLogprobsRequest& request, int64_t max_message_bytes) {
  return CheckResponseFits(
      ComputeLogprobsResponseBound(request), max_message_bytes,
      absl::StrCat(request.prompts_size(),
                   " prompts' log-probabilities with topk ", request.topk()),
      "topk or the prompts' tokens");
}

}  // namespace tally
