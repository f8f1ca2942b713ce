// Sampling parameters and the arguments of a Sample or ComputeLogprobs call,
// torch-free: the server parses requests into them (server/convert.h) and
// checks their ranges without LibTorch; the sampler (runtime/sample) and the
// engine's sample call (runtime/engine/sample_call.h) take them as they are.
// Token ranges need the model's vocabulary and are checked by the engine.
//
//   tally::SampleArgs args;
//   args.prompts = {{1, 5, 9}};
//   args.num_samples = 4;
//   args.max_tokens = 32;
//   args.sampling.temperature = 0.7;
//   TALLY_RETURN_IF_ERROR(tally::ValidateSamplingParams(args.sampling));
//   TALLY_ASSIGN_OR_RETURN(tally::SampleCallResult result,
//                          engine->Sample(model_id, args));
#ifndef TALLY_RUNTIME_CONFIG_SAMPLING_PARAMS_H_
#define TALLY_RUNTIME_CONFIG_SAMPLING_PARAMS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tally {

// How each token is chosen from a step's logits (runtime/sample/sampling.h).
struct SamplingParams {
  double temperature = 1.0;  // >= 0; 0: greedy
  double top_p = 1.0;        // in (0, 1]; 1: off
  int64_t top_k = -1;        // -1: off, else >= 1
};

// INVALID_ARGUMENT naming the field (temperature, top_p, top_k) that is out
// of its range above or not finite.
absl::Status ValidateSamplingParams(const SamplingParams& params);

using TokenIds = std::vector<int64_t>;

// INVALID_ARGUMENT naming `field`[j] for a token id of `tokens` outside
// [0, vocab_size); with vocab_size -1 (not known here), for a negative one.
absl::Status CheckTokenIds(const TokenIds& tokens, const std::string& field,
                           int64_t vocab_size = -1);

// What ends a sampled sequence besides max_tokens: a generated token in
// token_ids, or generated tokens ending with one of `sequences` (each
// non-empty). The stop token or sequence stays in the sequence.
struct StopConditions {
  TokenIds token_ids;
  std::vector<TokenIds> sequences;
};

// A Sample call: prompts x num_samples sequences, prompt-major (sequence
// p * num_samples + s is sample s of prompt p and draws from the stream of
// (seed, p * num_samples + s)).
struct SampleArgs {
  std::vector<TokenIds> prompts;  // each non-empty
  int64_t num_samples = 1;        // >= 1
  int64_t max_tokens = 16;        // >= 1
  SamplingParams sampling;
  // Absent: the engine draws one from a nondeterministic source and
  // returns it.
  std::optional<uint64_t> seed;
  // Absent: the model's EOS tokens (ModelSummary::eos_token_ids).
  std::optional<StopConditions> stop;
  // Also return each prompt's log-probabilities, and (> 0) the top-k of
  // every prompt position.
  bool include_prompt_logprobs = false;
  int64_t topk_prompt_logprobs = 0;
};

// A ComputeLogprobs call.
struct LogprobsArgs {
  std::vector<TokenIds> prompts;  // each non-empty
  int64_t topk = 0;               // >= 0; 0: none
};

// INVALID_ARGUMENT naming the field for what the arguments alone show to
// be wrong (token ranges need the model, the engine checks them): no
// prompts, an empty prompts[i], a negative prompts[i].tokens[j],
// num_samples or max_tokens < 1, sampling's ranges (params.temperature,
// params.top_p, params.top_k), a negative stop token or an empty stop
// sequence, topk_prompt_logprobs < 0.
absl::Status ValidateSampleArgs(const SampleArgs& args);
// The same for a ComputeLogprobs call (prompts, topk).
absl::Status ValidateLogprobsArgs(const LogprobsArgs& args);

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_SAMPLING_PARAMS_H_
