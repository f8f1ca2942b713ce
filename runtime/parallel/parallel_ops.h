// Differentiable parallel building blocks: the ZeRO-3 / FSDP parameter gather,
// the context-parallel key/value gather and the Megatron tensor-parallel
// region, embedding and cross-entropy ops.
//
// Each op is a LibTorch autograd Function whose forward and backward issue
// their collectives explicitly through a Communicator, so gradients never flow
// "through" a collective by accident and the number of collectives per op is
// fixed (tests count them through the Communicator's stats; on Gloo the
// Communicator's ReduceScatter is itself an all-reduce plus a local slice):
//
//   op                              forward                 backward
//   GatherShardedParameter          1 AllGather             1 ReduceScatter
//   UseGatheredCopy (ZeRO-2)        none                    1 ReduceScatter
//                                                           (+1 AllReduce
//                                                           with tp_sum)
//   UseGatheredCopy (ZeRO-1)        none                    none (1 AllReduce
//                                                           with tp_sum)
//   GatherSequenceBlocks            1 AllGather             1 ReduceScatter
//   ReduceScatterRows               1 ReduceScatter         1 AllGather
//   CopyToTensorParallelRegion      none                    1 AllReduce(SUM)
//   ReduceFromTensorParallelRegion  1 AllReduce(SUM)        none
//   VocabParallelEmbedding          1 AllReduce(SUM)        none
//   VocabParallelTargetLogprobs     2 AllReduce (MAX; SUM   none
//                                   of [sum-exp, target])
//   GatherVocabShards (decoding)    1 AllGather             (none: no
//                                                           gradient)
//   ColumnParallelLinear            none                    none (1 AllReduce
//                                                           with
//                                                           weight_tp_sum)
//   RowParallelLinear               none                    none
//
// Gradient reductions always SUM (never average): tally normalizes by the
// global token count in the loss, so averaging here would scale by 1/group.
//
// Contract shared by every op:
// - Autograd has no Status channel, so failures (bad shapes, a failed
//   collective) throw c10::Error; call the ops inside tally::CatchTorch.
//   Argument checks depend only on values every rank of the group shares
//   (shapes, the targets a tp group sees alike), so they fail on all ranks
//   together instead of leaving peers blocked in a collective.
// - Every rank of the group must build the same graph: the autograd engine
//   then runs the backward collectives in the same order everywhere. On CPU
//   the backward runs on the thread that calls backward().
// - The Communicator is held by address inside the graph; it must outlive
//   every graph built with it (the runtime creates its groups once at
//   start-up; graphs die with the ForwardBackward that built them).
// - Every op takes float or double tensors of any shape [..., D]. Outputs
//   must not be modified in place (they carry a custom backward).
//
//   torch::Tensor w_shard = tally::ShardDim0(w_full, dp_rank, dp_size)
//                               .requires_grad_();
//   torch::Tensor w = tally::GatherShardedParameter(w_shard, w_full.size(0),
//                                                   dp_shard_group);
//   torch::Tensor h = tally::CopyToTensorParallelRegion(x, tp_group);
//   torch::Tensor y = tally::ReduceFromTensorParallelRegion(
//       torch::linear(torch::linear(h, w1_shard).relu(), w2_shard), tp_group);
#ifndef TALLY_RUNTIME_PARALLEL_PARALLEL_OPS_H_
#define TALLY_RUNTIME_PARALLEL_PARALLEL_OPS_H_

#include <torch/torch.h>

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/parameter.h"

namespace tally {

// Rows of each dim-0 shard when `full_dim0` rows are split over `size` ranks:
// ceil(full_dim0 / size), so every shard has the same (padded) shape.
int64_t ShardRows(int64_t full_dim0, int size);

// Rank `rank`'s dim-0 shard of `full`: ShardRows(full.size(0), size) rows,
// the rows past the end of `full` zero. A fresh tensor (differentiable through
// plain ops; detach it to make a leaf parameter).
torch::Tensor ShardDim0(const torch::Tensor& full, int rank, int size);

// ZeRO-3: the full parameter from every rank's equal-sized `shard`. Forward
// all-gathers and keeps the first `full_dim0` rows; backward zero-pads the
// full gradient back to group.size() * shard rows and reduce-scatters it with
// SUM, so `shard.grad` receives the sum over the group of its rows' gradients
// (padding rows get zero). With `compute` (mixed precision: a float32 master
// shard, bfloat16 compute) the forward casts the shard before gathering it
// (half the bytes) and returns `compute`; the backward widens the gradient
// to shard's dtype before reducing it, so the sum runs and lands in float32
// and is never rounded to bfloat16.
torch::Tensor GatherShardedParameter(
    const torch::Tensor& shard, int64_t full_dim0, Communicator& group,
    std::optional<torch::ScalarType> compute = std::nullopt);

// ZeRO stages 1 and 2 (runtime/parallel/zero.h): the kept `copy.value` as the
// full parameter of `shard` (this rank's dim-0 shard, whose gradient the op
// feeds). Forward communicates nothing. Backward widens the gradient to
// shard's dtype (float32 for a mixed-precision master), then: with
// copy.whole_gradient (stage 1) it adds it to copy.grad (allocated at the
// first backward) and gives `shard` none; otherwise (stage 2) it
// reduce-scatters it into shard's rows as GatherShardedParameter does. With
// `tp_sum` (a tp-replicated weight read inside the tensor-parallel region)
// the gradient is also summed over that group, in the same dtype: stage 1's
// whole gradient before it is added, stage 2's shard after its
// reduce-scatter. The copy must outlive the graph.
torch::Tensor UseGatheredCopy(const torch::Tensor& shard, GatheredCopy& copy,
                              Communicator& group,
                              Communicator* tp_sum = nullptr);

// ZeRO's gradient reduce-scatter: the sum over `group` of every rank's
// `full` [full_dim0, ...], zero-padded to group.size() * ShardRows rows, and
// this rank's dim-0 shard of it (what GatherShardedParameter's backward
// returns). A collective's error is returned as is.
absl::StatusOr<torch::Tensor> ReduceScatterShards(const torch::Tensor& full,
                                                  Communicator& group);

// Context parallelism: every cp rank's block of keys or values
// x [B, H, T_block, D] (equal T_block on every rank), concatenated along the
// sequence in cp rank order: [B, H, group.size() * T_block, D]. Every rank's
// queries read every block, so the backward reduce-scatters (SUM) the full
// gradient and each rank gets the sum of all queries' gradients for its own
// block.
torch::Tensor GatherSequenceBlocks(const torch::Tensor& x, Communicator& group);

// Expert parallelism's combine: every rank's partial outputs x [rows, ...]
// (rows divisible by group.size()) summed, and this rank's slice of the
// rows returned: [rows / group.size(), ...]. The backward all-gathers the
// slices' gradients, since every rank's partial fed every slice. The dispatch
// before it is GatherShardedParameter over equal (padded) token blocks.
torch::Tensor ReduceScatterRows(const torch::Tensor& x, Communicator& group);

// Megatron's "f": the input of a column-parallel layer. Forward is the
// identity; backward sums the partial input gradients of the tp ranks
// (bfloat16 ones in float32, rounded back once).
torch::Tensor CopyToTensorParallelRegion(const torch::Tensor& x,
                                         Communicator& tp);

// Megatron's "g": the output of a row-parallel layer. Forward sums the tp
// ranks' partial outputs (bfloat16 ones in float32, rounded back once);
// backward is the identity.
torch::Tensor ReduceFromTensorParallelRegion(const torch::Tensor& x,
                                             Communicator& tp);

// The tensor-parallel linears of a bfloat16 model (docs/distributed.md,
// "bf16 reductions"): the products that are partial sums over tp (a
// row-parallel output, a column-parallel input gradient) stay in float32,
// so the tp sum rounds them once, as one rank's matmul rounds the whole
// once; every other product is complete on the rank and rounded once to
// its dtype, as one rank's. On the CPU a
// bfloat16 product with a float32 result runs through oneDNN
// (kernels/onednn_matmul.h); other operands are widened. Any floating
// dtype works (float32 and float64 compute in their own dtype).
//
//   torch::Tensor x = CopyToTensorParallelRegion(h.to(torch::kFloat32), tp);
//   torch::Tensor a =
//       torch::silu(ColumnParallelLinear(x, w_gate, torch::kBFloat16));
//   torch::Tensor y = ReduceFromTensorParallelRegion(
//       RowParallelLinear(a, w_down), tp).to(torch::kBFloat16);

// A column-parallel linear on the tp region's input. x [..., in] is that
// input in float32 (for a bfloat16 w: the widened bfloat16 activations, so
// its gradient, a partial sum over tp, accumulates in float32 before
// CopyToTensorParallelRegion sums it); w [out_local, in] and the optional
// bias [out_local] in the compute dtype. Forward: x @ w^T + bias summed in
// float32 and rounded once to w's dtype (as one rank's fused linear), then
// returned as `out_type`. Backward, all with float32 sums: x's gradient
// g @ w, kept in float32; the bias's, the sum of g over rows, rounded once;
// w's, g^T x, rounded once to w's dtype. With out_type float32, g is itself
// a partial sum over tp (the LoRA factors, runtime/model/lora.h) and so is w's
// gradient: `weight_tp_sum` (w whole on every rank of that group) sums it in
// float32 before that one rounding, as one rank rounds its whole product
// once; w must then not be summed over tp again.
torch::Tensor ColumnParallelLinear(const torch::Tensor& x,
                                   const torch::Tensor& w,
                                   torch::ScalarType out_type,
                                   const torch::Tensor& bias = {},
                                   Communicator* weight_tp_sum = nullptr);

// A row-parallel linear: x [..., in_local] and w [out, in_local] in the
// compute dtype. Forward: the partial output x @ w^T in float32 (for
// ReduceFromTensorParallelRegion to sum, then one rounding). Backward: the
// gradient of the sum is rounded to w's dtype, then x's and w's gradients
// are computed with float32 sums and rounded once to their dtypes.
torch::Tensor RowParallelLinear(const torch::Tensor& x, const torch::Tensor& w);

// Embedding whose rows [vocab_start, vocab_start + weight_shard.size(0)) live
// on this rank. ids [...] (int64, global) outside that range contribute zero
// rows here; the tp sum then yields the full embedding [..., D] on every rank.
// weight_shard's gradient is local (rows of ids this rank owns).
torch::Tensor VocabParallelEmbedding(const torch::Tensor& ids,
                                     const torch::Tensor& weight_shard,
                                     int64_t vocab_start, Communicator& tp);

// log softmax(full logits)[target] without gathering the logits.
// logits_shard [..., V / tp] is this rank's vocab slice starting at
// `vocab_start` (equal slices, vocab = V/tp * tp.size()); targets [...] are
// global ids in [0, vocab). Returns [...] identical on every tp rank.
// Backward (no collective): d/d logits_shard = g * (onehot_local - softmax),
// where onehot_local is zero on ranks that do not own the target.
torch::Tensor VocabParallelTargetLogprobs(const torch::Tensor& logits_shard,
                                          const torch::Tensor& targets,
                                          int64_t vocab_start,
                                          Communicator& tp);

// Decoding, without gradients: every tp rank's vocabulary slice
// shard [..., V / tp] (rank r's holds ids [r V / tp, (r + 1) V / tp))
// concatenated along the last dim in tp rank order, so every rank holds the
// whole logits [..., V], bitwise alike. One AllGather; its error is returned.
absl::StatusOr<torch::Tensor> GatherVocabShards(const torch::Tensor& shard,
                                                Communicator& tp);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_PARALLEL_OPS_H_
