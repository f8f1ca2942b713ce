// Decode: sampling completions of a batch of prompts from a CausalLm, on one
// rank. The prompts are prefilled together (right-padded, one forward), then
// every unfinished sequence gets one token per step from a forward over its
// last token with a KV cache (kv_cache.h); a sequence that stops leaves the
// batch (and the cache) at once. Tokens are chosen by sampling.h from the
// logits, sequence i drawing from SequenceGenerator(seed, i), so a
// sequence's tokens do not depend on the other prompts of the call.
//
// On a mesh every rank calls Decode with the same request and its
// DecodeGroups, and every rank returns the same whole result, equal to the
// single rank's (mesh_decode.h says what each dimension does).
//
// Not yet: prompt log-probabilities, deadlines and cancellation, memory
// admission of the cache (KvCache::bytes says what it holds).
//
//   tally::DecodeRequest request;
//   request.prompts = {{1, 5, 9}, {1, 7}};
//   request.max_tokens = 32;
//   request.sampling.temperature = 0;  // greedy
//   request.stop = {{2}};               // EOS
//   TALLY_ASSIGN_OR_RETURN(std::vector<tally::DecodedSequence> out,
//                          tally::Decode(model, request));
//   // On a mesh, on every rank (EngineGroups, engine_groups.h):
//   tally::DecodeGroups groups{engine_groups.data_and_cp, engine_groups.pp};
//   TALLY_ASSIGN_OR_RETURN(out, tally::Decode(model, request, groups));
#ifndef TALLY_RUNTIME_SAMPLE_DECODE_H_
#define TALLY_RUNTIME_SAMPLE_DECODE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/model/causal_lm.h"
#include "runtime/sample/decode_types.h"

namespace tally {

// INVALID_ARGUMENT naming the field: no prompts, an empty prompts[i], a
// token of prompts[i] or stop[i] outside [0, vocab_size), an empty stop[i],
// max_tokens < 1, or sampling's (ValidateSamplingParams).
absl::Status ValidateDecodeRequest(const DecodeRequest& request,
                                   int64_t vocab_size);

// The completions of request.prompts, in order: on one rank, or on every
// rank of a mesh whose ranks each decode every sequence (tp, dp_shard, ep
// and cp work without groups; pp needs DecodeGroups). Errors of validation
// above, UNIMPLEMENTED for a pipeline stage, and those of
// CausalLm::ForwardWithCache.
absl::StatusOr<std::vector<DecodedSequence>> Decode(
    CausalLm& model, const DecodeRequest& request);
// The same on a mesh, every rank calling it with the same request: the data
// ranks split the sequences, the pipeline stages pass activations on.
// INVALID_ARGUMENT naming groups.pp when it is not this stage's pipeline;
// a collective's error as it comes.
absl::StatusOr<std::vector<DecodedSequence>> Decode(
    CausalLm& model, const DecodeRequest& request, const DecodeGroups& groups);

}  // namespace tally

#endif  // TALLY_RUNTIME_SAMPLE_DECODE_H_
