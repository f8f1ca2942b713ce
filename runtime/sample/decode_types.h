// The data of a decode (decode.h): the request, each sequence's result and
// the groups a decode on a mesh runs over (mesh_decode.h), in a header of
// their own so that decode.h and mesh_decode.h both read them. What a decode
// reports as it goes (DecodeStats) and how it is stopped (DecodeControl)
// are in decode_control.h, torch-free for the server.
//
//   tally::DecodeRequest request;
//   request.prompts = {{1, 5, 9}};
//   request.sampling.temperature = 0;  // greedy
//   tally::DecodeGroups groups{engine_groups.data_and_cp, engine_groups.pp};
#ifndef TALLY_RUNTIME_SAMPLE_DECODE_TYPES_H_
#define TALLY_RUNTIME_SAMPLE_DECODE_TYPES_H_

#include <cstdint>
#include <vector>

#include "runtime/parallel/communicator.h"
#include "runtime/sample/decode_control.h"
#include "runtime/sample/sampling.h"

namespace tally {

struct DecodeRequest {
  std::vector<std::vector<int64_t>> prompts;  // token ids, each non-empty
  int64_t max_tokens = 16;  // the most tokens generated per sequence, >= 1
  SamplingParams sampling;
  // A sequence stops as soon as its generated tokens end with one of these
  // (a stop token is a sequence of one); they stay in its tokens.
  std::vector<std::vector<int64_t>> stop;
  uint64_t seed = 0;
};

enum class StopReason { kLength, kStop };

struct DecodedSequence {
  std::vector<int64_t> tokens;  // the generated tokens, without the prompt
  // Per token: log p(token | prompt and the tokens before it) under the
  // model's distribution before temperature, top-k and top-p.
  std::vector<double> logprobs;
  StopReason stop_reason = StopReason::kLength;
};

// The groups a decode on a mesh runs over besides the model's own
// (CausalLm::sharding).
struct DecodeGroups {
  // The ranks that split the sequences, each decoding a contiguous block by
  // index, all of them then gathering every block: ranks of this rank's tp
  // and pp coordinates (the engine's data x cp ranks,
  // EngineGroups::data_and_cp). Null: this rank decodes every sequence.
  Communicator* data = nullptr;
  // The stages of this rank's pipeline, group rank = stage (EngineGroups::pp);
  // required for a model split over pp.
  Communicator* pp = nullptr;
  // Every rank of the mesh: they agree every kStopCheckSteps steps whether
  // to stop (decode_control.h), rank 0 alone knowing of a cancellation.
  // Null: this rank stops on its own DecodeControl (a single rank).
  Communicator* all = nullptr;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_SAMPLE_DECODE_TYPES_H_
