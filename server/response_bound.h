// Response bounds of the sampling calls: an upper bound of the serialized
// SampleResponse or ComputeLogprobsResponse a request can get, known from the
// request alone, so that a call whose answer could exceed gRPC's message
// limit (--max-message-bytes) is refused before it runs rather than after
// the work is done (gRPC would then fail the reply with RESOURCE_EXHAUSTED).
//
//   TALLY_RETURN_IF_ERROR(
//       tally::CheckSampleResponseFits(request, options.max_message_bytes));
#ifndef TALLY_SERVER_RESPONSE_BOUND_H_
#define TALLY_SERVER_RESPONSE_BOUND_H_

#include <cstdint>

#include "absl/status/status.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

// The largest SampleResponse `request` can get: prompts x num_samples
// sequences of params.max_tokens tokens with their log-probabilities, and
// with include_prompt_logprobs or topk_prompt_logprobs each prompt's
// log-probabilities and top-k entries. Saturates below INT64_MAX.
int64_t SampleResponseBound(const v1::SampleRequest& request);
// The largest ComputeLogprobsResponse `request` can get.
int64_t ComputeLogprobsResponseBound(const v1::ComputeLogprobsRequest& request);

// RESOURCE_EXHAUSTED (ErrorReason::kMessageTooLarge) naming the request's
// fields and --max-message-bytes when its bound exceeds `max_message_bytes`
// (0: no limit); OK otherwise.
absl::Status CheckSampleResponseFits(const v1::SampleRequest& request,
                                     int64_t max_message_bytes);
absl::Status CheckComputeLogprobsResponseFits(
    const v1::ComputeLogprobsRequest& request, int64_t max_message_bytes);

}  // namespace tally

#endif  // TALLY_SERVER_RESPONSE_BOUND_H_
