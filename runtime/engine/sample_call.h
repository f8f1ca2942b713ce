// The Sample and ComputeLogprobs calls of one model on one rank, over the
// model as it stands: its weights after the last OptimStep. Sampling reads
// the parameters without gradients, so a pending accumulation window is
// neither visible to it nor changed. A Sample expands its prompts into
// prompts x num_samples sequences, prompt-major, and decodes them together
// (runtime/sample/decode.h): sequence i = p * num_samples + s draws from the
// stream of (seed, i) alone. Prompt log-probabilities come from
// runtime/sample/prompt_logprobs.h. The engine (Engine::Sample,
// Engine::ComputeLogprobs) checks the model and the mesh first.
//
//   tally::SampleArgs args;
//   args.prompts = {{1, 5, 9}};
//   args.num_samples = 2;
//   args.seed = 7;
//   TALLY_ASSIGN_OR_RETURN(
//       tally::SampleCallResult result,
//       tally::RunSampleCall(model, args, /*eos_token_ids=*/{2}));
#ifndef TALLY_RUNTIME_ENGINE_SAMPLE_CALL_H_
#define TALLY_RUNTIME_ENGINE_SAMPLE_CALL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/config/sampling_params.h"
#include "runtime/model/causal_lm.h"
#include "runtime/parallel/mesh.h"
#include "runtime/sample/decode.h"
#include "runtime/sample/prompt_logprobs.h"

namespace tally {

struct SampleCallResult {
  // prompts x num_samples sequences, prompt-major.
  std::vector<DecodedSequence> sequences;
  // One per prompt with include_prompt_logprobs or topk_prompt_logprobs.
  std::vector<PromptLogprobs> prompt_logprobs;
  uint64_t seed = 0;  // the seed the sequences were drawn with
  int64_t step = 0;   // the model's step whose weights sampled
};

struct LogprobsCallResult {
  std::vector<PromptLogprobs> prompts;  // one per prompt, in order
  int64_t step = 0;
};

// UNIMPLEMENTED naming the mesh unless it is a single rank: what sampling
// runs on for now.
absl::Status CheckSamplingMesh(const Mesh& mesh, const char* call);

// A seed from a nondeterministic source, for a Sample that names none.
uint64_t DrawSeed();

// Runs `args` (ValidateSampleArgs first, sampling_params.h; token ids are
// checked against the vocabulary here, as prompts[i].tokens[j],
// params.stop.token_ids[j], params.stop.sequences[i].tokens[j], and
// topk_prompt_logprobs against its size). The default stop tokens are
// `eos_token_ids` within the vocabulary. result.step is left for the caller.
absl::StatusOr<SampleCallResult> RunSampleCall(
    CausalLm& model, const SampleArgs& args,
    const std::vector<int64_t>& eos_token_ids);

// Runs `args` (ValidateLogprobsArgs first); result.step is left for the
// caller.
absl::StatusOr<LogprobsCallResult> RunLogprobsCall(CausalLm& model,
                                                   const LogprobsArgs& args);

}  // namespace tally

#endif  // TALLY_RUNTIME_ENGINE_SAMPLE_CALL_H_
