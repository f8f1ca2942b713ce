// ZeRO stages 1 and 2 over dp_shard: the parameters stay sharded exactly as
// under stage 3 (FSDP) — the optimizer, the gradient norm and checkpoints see
// the same dim-0 shards, so checkpoints move freely between stages — and each
// rank also keeps every dp_shard-sharded parameter gathered
// (Parameter::gathered) from one optimizer step to the next, so a forward or
// backward pass gathers nothing.
//
//   stage  parameters  gradients               collectives per window
//   1      gathered    whole, local until the  1 reduce-scatter per sync
//                      window is summed        (EAGER: per call; DEFERRED:
//                                              at OptimStep), 1 all-gather
//                                              per step
//   2      gathered    reduce-scattered into   1 reduce-scatter per use per
//                      the shard every pass    pass, 1 all-gather per step
//   3      gathered    reduce-scattered every  1 all-gather and 1 reduce-
//          per pass    pass                    scatter per use per pass
//
// BuiltModel (runtime/engine/built_model.h) refreshes the gathered copies
// after anything changes the shards (creation, LoadCheckpoint, OptimStep),
// and its GradientSync (runtime/train/gradient_sync.h), at stage 1, reduces
// the whole gradients where it sums a window over the replicas.
//
//   torch::Tensor w = tally::GatheredWeight(p, dp_shard);  // in forward
//   ... backward ...
//   TALLY_RETURN_IF_ERROR(tally::ReduceWholeGradients(params, dp_shard));
//   ... optimizer step on the shards ...
//   TALLY_RETURN_IF_ERROR(tally::RefreshGatheredCopies(
//       params, compute_type, dp_shard,
//       [](const tally::Parameter& p) { return p.trainable; }));
#ifndef TALLY_RUNTIME_PARALLEL_ZERO_H_
#define TALLY_RUNTIME_PARALLEL_ZERO_H_

#include <torch/torch.h>

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/parameter.h"

namespace tally {

// The whole tp-local weight of `p` (p.gathered set and refreshed) for a
// pass: its gathered copy, with no collective. Differentiable when p trains:
// at stage 2 the backward reduce-scatters (SUM) the gradient over `dp_shard`
// into p.tensor's .grad, as ZeRO-3's GatherShardedParameter does; at stage 1
// it adds the gradient to p.gathered->grad and communicates nothing. Both
// reduce in p.tensor's dtype (float32 for a mixed-precision master). With
// `tp_sum` (a tp-replicated weight read inside the tensor-parallel region)
// the gradient also sums over that group (UseGatheredCopy). Throws
// c10::Error when the copy was never gathered (call inside CatchTorch).
torch::Tensor GatheredWeight(const Parameter& p, Communicator& dp_shard,
                             Communicator* tp_sum = nullptr);

// Gathers the copy of every parameter of `params` that keeps one and is
// `selected` from this rank's shard and its dp_shard peers', cast to
// `compute`: one all-gather per parameter. Every rank of the group must
// select the same parameters. The local work that can fail (the casts) is
// done and agreed over the group first, so a rank that fails it leaves no
// peer waiting in a gather.
absl::Status RefreshGatheredCopies(
    std::vector<Parameter>& params, torch::ScalarType compute,
    Communicator& dp_shard,
    const std::function<bool(const Parameter& p)>& selected);

// Whether some trainable parameter of `params` keeps a whole gradient
// (ZeRO stage 1 on a dp_shard group of more than one rank).
bool KeepsWholeGradients(const std::vector<Parameter>& params);

// Stage 1's gradient reduction: every trainable parameter's whole gradient
// (zeros where no backward made one, so every rank issues the same
// collectives) is reduce-scattered (SUM) over `dp_shard`, this rank's rows
// added to p.tensor's .grad, and the whole gradient zeroed for the next
// backward. One reduce-scatter per parameter; a collective's error is
// returned as is.
absl::Status ReduceWholeGradients(std::vector<Parameter>& params,
                                  Communicator& dp_shard);

// The bytes this rank holds beyond the shards: the gathered copies and the
// whole gradients.
struct GatheredBytes {
  double parameters = 0;
  double gradients = 0;
};
GatheredBytes GatheredStateBytes(const std::vector<Parameter>& params);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_ZERO_H_
