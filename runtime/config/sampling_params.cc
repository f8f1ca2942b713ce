#include "runtime/config/sampling_params.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace tally {

absl::Status ValidateSamplingParams(const SamplingParams& params) {
  if (!std::isfinite(params.temperature) || params.temperature < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be a finite number >= 0 (0: greedy), "
                     "got ",
                     params.temperature));
  }
  if (!(params.top_p > 0 && params.top_p <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p must be in (0, 1] (1: off), got ", params.top_p));
  }
  if (params.top_k != -1 && params.top_k < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top_k must be -1 (off) or at least 1, got ", params.top_k));
  }
  return absl::OkStatus();
}

absl::Status CheckTokenIds(const TokenIds& tokens, const std::string& field,
                           int64_t vocab_size) {
  for (size_t j = 0; j < tokens.size(); ++j) {
    if (tokens[j] >= 0 && (vocab_size < 0 || tokens[j] < vocab_size)) continue;
    return absl::InvalidArgumentError(
        vocab_size < 0
            ? absl::StrCat(field, "[", j, "] = ", tokens[j],
                           " is not a token id (< 0)")
            : absl::StrCat(field, "[", j, "] = ", tokens[j],
                           " is not a token id in [0, ", vocab_size, ")"));
  }
  return absl::OkStatus();
}

namespace {

absl::Status ValidatePrompts(const std::vector<TokenIds>& prompts) {
  if (prompts.empty()) {
    return absl::InvalidArgumentError("prompts is empty: nothing to run");
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompts[", i, "].tokens is empty"));
    }
    TALLY_RETURN_IF_ERROR(
        CheckTokenIds(prompts[i], absl::StrCat("prompts[", i, "].tokens")));
  }
  return absl::OkStatus();
}

absl::Status ValidateStop(const StopConditions& stop) {
  TALLY_RETURN_IF_ERROR(CheckTokenIds(stop.token_ids, "params.stop.token_ids"));
  for (size_t i = 0; i < stop.sequences.size(); ++i) {
    const std::string field = absl::StrCat("params.stop.sequences[", i, "]");
    if (stop.sequences[i].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".tokens is empty"));
    }
    TALLY_RETURN_IF_ERROR(
        CheckTokenIds(stop.sequences[i], absl::StrCat(field, ".tokens")));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSampleArgs(const SampleArgs& args) {
  TALLY_RETURN_IF_ERROR(ValidatePrompts(args.prompts));
  if (args.num_samples < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_samples must be at least 1, got ", args.num_samples));
  }
  if (args.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "params.max_tokens must be at least 1, got ", args.max_tokens));
  }
  if (absl::Status sampling = ValidateSamplingParams(args.sampling);
      !sampling.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("params.", sampling.message()));
  }
  if (args.stop) TALLY_RETURN_IF_ERROR(ValidateStop(*args.stop));
  if (args.topk_prompt_logprobs < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_prompt_logprobs must be >= 0 (0: none), got ",
                     args.topk_prompt_logprobs));
  }
  return absl::OkStatus();
}

absl::Status ValidateLogprobsArgs(const LogprobsArgs& args) {
  TALLY_RETURN_IF_ERROR(ValidatePrompts(args.prompts));
  if (args.topk < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk must be >= 0 (0: none), got ", args.topk));
  }
  return absl::OkStatus();
}

}  // namespace tally
