// Prompt log-probabilities: one forward of each prompt through a CausalLm on
// one rank (no cache kept), log_softmax of the logits, and at every position
// the log-probability of the prompt's next token — what ForwardBackward's
// return_logprobs computes for the same sequence — with, optionally, the k
// most probable next tokens (the lower id first among equal
// log-probabilities). Serves ComputeLogprobs and Sample's prompt logprobs.
//
//   TALLY_ASSIGN_OR_RETURN(
//       std::vector<tally::PromptLogprobs> out,
//       tally::ComputePromptLogprobs(model, {{1, 5, 9}, {1, 7}}, /*topk=*/2));
//   // out[0].logprobs[1] == log p(9 | 1, 5); out[0].topk[1] its top 2.
#ifndef TALLY_RUNTIME_SAMPLE_PROMPT_LOGPROBS_H_
#define TALLY_RUNTIME_SAMPLE_PROMPT_LOGPROBS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/config/sampling_params.h"
#include "runtime/model/causal_lm.h"

namespace tally {

// The k most probable tokens at one position, most probable first.
struct TopkLogprobs {
  std::vector<int64_t> tokens;
  std::vector<double> logprobs;
};

// A prompt's log-probabilities, one per token after the first:
// logprobs[i] = log p(prompt[i + 1] | prompt[0..i]); topk[i] (with topk > 0)
// the most probable tokens at that position.
struct PromptLogprobs {
  std::vector<double> logprobs;
  std::vector<TopkLogprobs> topk;
};

// One PromptLogprobs per prompt, in order, in the logits' dtype (float32 at
// least) widened to double. INVALID_ARGUMENT for an empty prompt, a token
// outside [0, vocab_size) (named as prompts[i].tokens[j]) or topk outside
// [0, vocab_size]; UNIMPLEMENTED where CausalLm::ForwardWithCache is.
absl::StatusOr<std::vector<PromptLogprobs>> ComputePromptLogprobs(
    CausalLm& model, const std::vector<TokenIds>& prompts, int64_t topk);

// INVALID_ARGUMENT naming prompts[i].tokens (empty) or prompts[i].tokens[j]
// (not a token id in [0, vocab_size)).
absl::Status CheckPromptTokens(const std::vector<TokenIds>& prompts,
                               int64_t vocab_size);

}  // namespace tally

#endif  // TALLY_RUNTIME_SAMPLE_PROMPT_LOGPROBS_H_
