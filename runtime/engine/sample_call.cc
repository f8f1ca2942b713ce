#include "runtime/engine/sample_call.h"

#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace tally {
namespace {

absl::Status CheckSampleTokens(const SampleArgs& args, int64_t vocab_size) {
  TALLY_RETURN_IF_ERROR(CheckPromptTokens(args.prompts, vocab_size));
  if (args.stop) {
    TALLY_RETURN_IF_ERROR(CheckTokenIds(args.stop->token_ids,
                                        "params.stop.token_ids", vocab_size));
    for (size_t i = 0; i < args.stop->sequences.size(); ++i) {
      TALLY_RETURN_IF_ERROR(CheckTokenIds(
          args.stop->sequences[i],
          absl::StrCat("params.stop.sequences[", i, "].tokens"), vocab_size));
    }
  }
  if (args.topk_prompt_logprobs > vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topk_prompt_logprobs must be at most vocab_size = ", vocab_size,
        ", got ", args.topk_prompt_logprobs));
  }
  return absl::OkStatus();
}

// The decoder's stop sequences: the call's conditions, else the model's EOS
// tokens within the vocabulary.
std::vector<TokenIds> StopSequences(const SampleArgs& args,
                                    const std::vector<int64_t>& eos_token_ids,
                                    int64_t vocab_size) {
  std::vector<TokenIds> stop;
  if (args.stop) {
    for (int64_t token : args.stop->token_ids) stop.push_back({token});
    for (const TokenIds& sequence : args.stop->sequences) {
      stop.push_back(sequence);
    }
    return stop;
  }
  for (int64_t token : eos_token_ids) {
    if (token >= 0 && token < vocab_size) stop.push_back({token});
  }
  return stop;
}

}  // namespace

uint64_t DrawSeed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^
         static_cast<uint64_t>(device());
}

absl::StatusOr<SampleCallResult> RunSampleCall(
    CausalLm& model, const SampleArgs& args,
    const std::vector<int64_t>& eos_token_ids, const DecodeGroups& groups) {
  TALLY_RETURN_IF_ERROR(ValidateSampleArgs(args));
  const int64_t vocab = model.config().vocab_size;
  TALLY_RETURN_IF_ERROR(CheckSampleTokens(args, vocab));
  SampleCallResult result;
  result.seed = args.seed.has_value() ? *args.seed : DrawSeed();
  DecodeRequest request;
  for (const TokenIds& prompt : args.prompts) {
    for (int64_t s = 0; s < args.num_samples; ++s) {
      request.prompts.push_back(prompt);
    }
  }
  request.max_tokens = args.max_tokens;
  request.sampling = args.sampling;
  request.stop = StopSequences(args, eos_token_ids, vocab);
  request.seed = result.seed;
  TALLY_ASSIGN_OR_RETURN(result.sequences, Decode(model, request, groups));
  if (args.include_prompt_logprobs || args.topk_prompt_logprobs > 0) {
    TALLY_ASSIGN_OR_RETURN(
        result.prompt_logprobs,
        ComputePromptLogprobs(model, args.prompts, args.topk_prompt_logprobs,
                              groups));
  }
  return result;
}

absl::StatusOr<LogprobsCallResult> RunLogprobsCall(CausalLm& model,
                                                   const LogprobsArgs& args,
                                                   const DecodeGroups& groups) {
  TALLY_RETURN_IF_ERROR(ValidateLogprobsArgs(args));
  // ComputePromptLogprobs checks the token ids and topk against the
  // vocabulary, naming them as the request does.
  LogprobsCallResult result;
  TALLY_ASSIGN_OR_RETURN(
      result.prompts,
      ComputePromptLogprobs(model, args.prompts, args.topk, groups));
  return result;
}

}  // namespace tally
