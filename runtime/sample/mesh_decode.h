// Mesh decoding: what Decode (decode.h) does besides the single-rank loop
// when a model is split over ranks. Every rank of the mesh calls Decode with
// the same request and gets the same whole result:
//
//   - the data ranks (DecodeGroups::data: dp_replicate x dp_shard x cp)
//     split the sequences into contiguous blocks by index (SequenceBlockOf),
//     decode their block, and all gather every block (GatherDecoded);
//   - the tp ranks of a data rank decode the same sequences; the model
//     shards heads and cache and gathers the logits, so they draw alike;
//   - the pipeline stages of a data rank pass activations stage to stage
//     (MeshStep::Forward), the last stage chooses the tokens and broadcasts
//     them to the others (MeshStep::Share);
//   - where the ranks of a block's forward must meet in collectives (dp_shard
//     gathers parameters, ep dispatches tokens), every data rank runs the
//     same number of forwards: before each one they agree whether any rank
//     still decodes (MeshStep::Agree), and a rank with nothing left runs an
//     idle forward over one dummy token (MeshStep::Idle);
//   - every kStopCheckSteps steps (decode_control.h) every rank of the mesh
//     (DecodeGroups::all) agrees whether any still decodes and whether to
//     stop, in one AllReduce that stands in for that step's agreement of the
//     data ranks: rank 0 alone knows that its caller gave up, and every rank
//     stops at the same step. A rank whose forwards meet no other data
//     rank's and that has nothing left joins these checks alone until every
//     rank is done.
//
// A sequence's tokens come from SequenceGenerator(seed, its index in the
// request), so they do not depend on which rank decodes it.
//
//   tally::MeshStep step(model, groups);
//   TALLY_ASSIGN_OR_RETURN(torch::Tensor logits,
//                          step.Forward(tokens, positions, valid, cache));
//   // logits: defined on the last stage only
//   TALLY_ASSIGN_OR_RETURN(chosen, step.Share(chosen, rows));
//   TALLY_ASSIGN_OR_RETURN(tally::StepAgreement agreed,
//                          step.Agree(!active.empty(), /*stop=*/false,
//                                     /*check=*/step_index % 8 == 0));
#ifndef TALLY_RUNTIME_SAMPLE_MESH_DECODE_H_
#define TALLY_RUNTIME_SAMPLE_MESH_DECODE_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/model/causal_lm.h"
#include "runtime/model/kv_cache.h"
#include "runtime/parallel/communicator.h"
#include "runtime/sample/decode_types.h"
#include "runtime/sample/sampling.h"

namespace tally {

// The sequences [begin, end) of a request's `count` that rank `rank` of
// `size` data ranks decodes: contiguous blocks, the first count % size one
// longer; empty for the ranks past the count.
struct SequenceBlock {
  int64_t begin = 0;
  int64_t end = 0;
};
SequenceBlock SequenceBlockOf(int64_t count, int rank, int size);

// Every data rank's decoded block, in sequence order, on every rank of
// `data` (`local`: this rank's block of the `count` sequences). The results
// vary in length, so each rank packs its block into one float64 vector
// (per sequence: its token count, stop reason, tokens, log-probabilities;
// token ids are exact in float64), the ranks all-gather the vectors'
// lengths, then the vectors padded to the longest: two AllGathers on
// `device` (the model's, so that a device communicator can carry them).
absl::StatusOr<std::vector<DecodedSequence>> GatherDecoded(
    const std::vector<DecodedSequence>& local, int64_t count,
    Communicator& data, const torch::Device& device);

// What the ranks agreed before a decoding step (MeshStep::Agree).
struct StepAgreement {
  bool more = false;  // some rank still decodes
  bool stop = false;  // some rank asked to stop: every one stops now
};

// What a rank returns once the ranks agreed to stop: `own`, its own reason
// (rank 0: its caller's), unless OK; else CANCELLED, another rank asked.
absl::Status StoppedBecause(const absl::Status& own);

// This rank's part of each decoding forward on the mesh.
class MeshStep {
 public:
  // For a model that is a stage of more than one: UNIMPLEMENTED without
  // groups.pp, INVALID_ARGUMENT when groups.pp is not its pipeline (another
  // size or rank).
  static absl::StatusOr<MeshStep> Create(CausalLm& model,
                                         const DecodeGroups& groups);

  // This stage's forward (CausalLm::ForwardWithCache) over the new tokens
  // [B, T] at `positions` of which `valid` are real: the first stage reads
  // `tokens`, the others the previous stage's hidden states, received; all
  // but the last send theirs on. Returns the logits [B, T, V] on the last
  // stage, an undefined tensor on the others.
  // `logits_at` as CausalLm::ForwardWithCache's (undefined: every
  // position).
  absl::StatusOr<torch::Tensor> Forward(
      const torch::Tensor& tokens, const torch::Tensor& positions,
      const torch::Tensor& valid, KvCache& cache,
      const torch::Tensor& logits_at = torch::Tensor());
  // The tokens and log-probabilities the last stage chose for its `rows`
  // rows (`chosen`, read there only), on every stage: one Broadcast over pp.
  absl::StatusOr<SampledTokens> Share(const SampledTokens& chosen,
                                      int64_t rows);
  // `on_last` (float64 of `shape`, read on the last stage only) on every
  // stage: one Broadcast over pp; itself when the model is not split over pp.
  absl::StatusOr<torch::Tensor> FromLastStage(const torch::Tensor& on_last,
                                              at::IntArrayRef shape);

  // Whether the forwards of different data ranks meet in collectives
  // (dp_shard or ep over more than one rank, and data ranks to split over),
  // so that they must run in step.
  bool lockstep() const { return lockstep_; }
  // Whether any rank still `decoding` and whether any asks to `stop`: at a
  // `check` step over every rank of DecodeGroups::all (one AllReduce of the
  // two flags); otherwise, under lockstep, over the data ranks (one
  // AllReduce; no rank asks to stop between checks); else this rank's own.
  // Every rank that takes part gets the same answer.
  absl::StatusOr<StepAgreement> Agree(bool decoding, bool stop, bool check);
  // Between pieces of work that every rank does alike but that are no
  // decoding steps (prompt log-probabilities): polls the thread's
  // DecodeControl and agrees with every rank of DecodeGroups::all whether
  // to stop (Agree at a check). OK: go on; else what to return
  // (StoppedBecause).
  absl::Status CheckStop();
  // A forward over one dummy token with a throwaway cache, for a rank with
  // nothing to decode while others decode: the same collectives as theirs,
  // no pp traffic (every stage of this rank's pipeline idles alike).
  absl::Status Idle();

 private:
  MeshStep(CausalLm& model, const DecodeGroups& groups, bool lockstep)
      : model_(&model), groups_(groups), lockstep_(lockstep) {}

  CausalLm* model_;
  DecodeGroups groups_;
  bool lockstep_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_SAMPLE_MESH_DECODE_H_
