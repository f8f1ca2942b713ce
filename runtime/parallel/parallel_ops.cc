#include "runtime/parallel/parallel_ops.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status.h"
#include "kernels/onednn_matmul.h"

namespace tally {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// torch::autograd::Function rather than a hand-written Node: it already wires
// non-tensor arguments, zero-fills undefined incoming gradients (a backward
// that runs always has a tensor to reduce, so no rank skips its collective)
// and re-wraps inputs returned unchanged. Its saved_data holds IValues only, so
// the Communicator travels as its address in an int64; that is safe because the
// communicator outlives every graph (see the header's contract).
constexpr char kGroupKey[] = "group";

void SaveGroup(AutogradContext* ctx, Communicator* group) {
  ctx->saved_data[kGroupKey] =
      static_cast<int64_t>(reinterpret_cast<intptr_t>(group));
}

// The group SaveGroup saved, or nullptr when it saved none.
Communicator* SavedOptionalGroup(AutogradContext* ctx) {
  return reinterpret_cast<Communicator*>(
      static_cast<intptr_t>(ctx->saved_data.at(kGroupKey).toInt()));
}

Communicator& SavedGroup(AutogradContext* ctx) {
  return *SavedOptionalGroup(ctx);
}

void ThrowIfError(const absl::Status& status, const char* what) {
  TORCH_CHECK(status.ok(), what, ": ", std::string(status.message()));
}

torch::Tensor ValueOrThrow(absl::StatusOr<torch::Tensor> result,
                           const char* what) {
  ThrowIfError(result.status(), what);
  return *std::move(result);
}

// The dtype a sum of `type` values runs in: float32 for bfloat16 and
// float16, whose partial sums would otherwise be rounded at every addition
// (NCCL adds them natively), the type itself otherwise.
torch::ScalarType SumType(torch::ScalarType type) {
  return type == torch::kBFloat16 || type == torch::kHalf ? torch::kFloat32
                                                          : type;
}

// Reduces into a dense buffer of its own: `t` may be an expanded or strided
// incoming gradient, or an input the caller still holds. A low-precision sum
// runs in float32 and is rounded back once.
torch::Tensor AllReduceSum(const torch::Tensor& t, Communicator& group,
                           const char* what) {
  torch::Tensor reduced = t.to(SumType(t.scalar_type()), /*non_blocking=*/false,
                               /*copy=*/true, at::MemoryFormat::Contiguous);
  ThrowIfError(group.AllReduce(reduced, ReduceOp::kSum), what);
  return reduced.to(t.scalar_type());
}

void CheckFloating(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined() && t.is_floating_point(), name,
              " must be a floating-point tensor");
}

}  // namespace

absl::StatusOr<torch::Tensor> ReduceScatterShards(const torch::Tensor& full,
                                                  Communicator& group) {
  const int64_t full_dim0 = full.size(0);
  const int64_t padded_rows = ShardRows(full_dim0, group.size()) * group.size();
  torch::Tensor padded = full;
  if (padded_rows > full_dim0) {
    std::vector<int64_t> pad_sizes = full.sizes().vec();
    pad_sizes[0] = padded_rows - full_dim0;
    padded = torch::cat({full, torch::zeros(pad_sizes, full.options())}, 0);
  }
  // A low-precision gradient (cp's key/value blocks) sums in float32 and is
  // rounded back once, as AllReduceSum's.
  const torch::ScalarType type = full.scalar_type();
  if (SumType(type) == type) return group.ReduceScatter(padded.contiguous());
  TALLY_ASSIGN_OR_RETURN(
      torch::Tensor shard,
      group.ReduceScatter(padded.to(SumType(type)).contiguous()));
  return shard.to(type);
}

namespace {

// The dtype of the shard (a mixed-precision master: float32) whose gradient
// a parameter gather's backward reduces: the sum runs in it and lands in it.
constexpr char kShardTypeKey[] = "shard_type";

torch::ScalarType SavedShardType(AutogradContext* ctx) {
  return static_cast<torch::ScalarType>(
      ctx->saved_data.at(kShardTypeKey).toInt());
}

class GatherShardedParameterFunction
    : public torch::autograd::Function<GatherShardedParameterFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& shard,
                               int64_t full_dim0, Communicator* group,
                               torch::ScalarType compute) {
    SaveGroup(ctx, group);
    ctx->saved_data[kShardTypeKey] = static_cast<int64_t>(shard.scalar_type());
    torch::Tensor gathered = ValueOrThrow(group->AllGather(shard.to(compute)),
                                          "GatherShardedParameter all_gather");
    // Shrinking a fresh tensor keeps its leading rows in place: no copy, and
    // the result is not a view callers could trip over.
    std::vector<int64_t> sizes = gathered.sizes().vec();
    sizes[0] = full_dim0;
    return gathered.resize_(sizes);
  }

  static variable_list backward(AutogradContext* ctx,
                                variable_list grad_outputs) {
    torch::Tensor shard_grad = ValueOrThrow(
        ReduceScatterShards(grad_outputs[0].to(SavedShardType(ctx)),
                            SavedGroup(ctx)),
        "GatherShardedParameter reduce_scatter");
    return {shard_grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The copy travels as its address, like the group: Parameter::gathered
// owns it for as long as the model lives.
constexpr char kCopyKey[] = "copy";
// The tp group a replicated weight's gradient sums over (0: none).
constexpr char kTpSumKey[] = "tp_sum";

class UseGatheredCopyFunction
    : public torch::autograd::Function<UseGatheredCopyFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& shard,
                               GatheredCopy* copy, Communicator* group,
                               Communicator* tp_sum) {
    SaveGroup(ctx, group);
    ctx->saved_data[kCopyKey] =
        static_cast<int64_t>(reinterpret_cast<intptr_t>(copy));
    ctx->saved_data[kTpSumKey] =
        static_cast<int64_t>(reinterpret_cast<intptr_t>(tp_sum));
    ctx->saved_data[kShardTypeKey] = static_cast<int64_t>(shard.scalar_type());
    // A view of its own: autograd records its history on the alias, never
    // on the kept tensor.
    return copy->value.alias();
  }

  static variable_list backward(AutogradContext* ctx,
                                variable_list grad_outputs) {
    GatheredCopy& copy = *reinterpret_cast<GatheredCopy*>(
        static_cast<intptr_t>(ctx->saved_data.at(kCopyKey).toInt()));
    Communicator* tp_sum = reinterpret_cast<Communicator*>(
        static_cast<intptr_t>(ctx->saved_data.at(kTpSumKey).toInt()));
    // Widened to the shard's dtype first (a mixed-precision master's
    // float32): the sums run in it and land in it unrounded.
    const torch::Tensor wide = grad_outputs[0].to(SavedShardType(ctx));
    if (copy.whole_gradient) {
      const torch::Tensor whole =
          tp_sum == nullptr
              ? wide
              : AllReduceSum(wide, *tp_sum, "UseGatheredCopy tp all_reduce");
      if (!copy.grad.defined()) {
        copy.grad = torch::zeros(whole.sizes(), whole.options());
      }
      copy.grad.add_(whole);
      return {torch::Tensor(), torch::Tensor(), torch::Tensor(),
              torch::Tensor()};
    }
    torch::Tensor shard_grad =
        ValueOrThrow(ReduceScatterShards(wide, SavedGroup(ctx)),
                     "UseGatheredCopy reduce_scatter");
    if (tp_sum != nullptr) {
      ThrowIfError(tp_sum->AllReduce(shard_grad, ReduceOp::kSum),
                   "UseGatheredCopy tp all_reduce");
    }
    return {shard_grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

class ReduceScatterRowsFunction
    : public torch::autograd::Function<ReduceScatterRowsFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               Communicator* group) {
    SaveGroup(ctx, group);
    return ValueOrThrow(group->ReduceScatter(x.contiguous()),
                        "ReduceScatterRows reduce_scatter");
  }

  static variable_list backward(AutogradContext* ctx,
                                variable_list grad_outputs) {
    return {
        ValueOrThrow(SavedGroup(ctx).AllGather(grad_outputs[0].contiguous()),
                     "ReduceScatterRows all_gather"),
        torch::Tensor()};
  }
};

class CopyToTensorParallelRegionFunction
    : public torch::autograd::Function<CopyToTensorParallelRegionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               Communicator* tp) {
    SaveGroup(ctx, tp);
    return x;
  }

  static variable_list backward(AutogradContext* ctx,
                                variable_list grad_outputs) {
    return {AllReduceSum(grad_outputs[0], SavedGroup(ctx),
                         "CopyToTensorParallelRegion all_reduce"),
            torch::Tensor()};
  }
};

class ReduceFromTensorParallelRegionFunction
    : public torch::autograd::Function<ReduceFromTensorParallelRegionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x,
                               Communicator* tp) {
    return AllReduceSum(x, *tp, "ReduceFromTensorParallelRegion all_reduce");
  }

  static variable_list backward(AutogradContext* /*ctx*/,
                                variable_list grad_outputs) {
    return {grad_outputs[0], torch::Tensor()};
  }
};

class VocabParallelTargetLogprobsFunction
    : public torch::autograd::Function<VocabParallelTargetLogprobsFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx,
                               const torch::Tensor& logits_shard,
                               const torch::Tensor& targets,
                               int64_t vocab_start, Communicator* tp) {
    const int64_t local_vocab = logits_shard.size(-1);
    const torch::Tensor owned =
        (targets >= vocab_start) & (targets < vocab_start + local_vocab);
    // Targets owned elsewhere read column 0 and are then zeroed by `owned`.
    const torch::Tensor local_index =
        (targets - vocab_start).masked_fill(~owned, 0).unsqueeze(-1);

    // The max only stabilizes exp(); its gradient contribution cancels, so
    // it is a constant here.
    torch::Tensor global_max = logits_shard.amax(-1);
    ThrowIfError(tp->AllReduce(global_max, ReduceOp::kMax),
                 "VocabParallelTargetLogprobs max all_reduce");
    torch::Tensor exp = (logits_shard - global_max.unsqueeze(-1)).exp();
    torch::Tensor target_logit =
        logits_shard.gather(-1, local_index).squeeze(-1).masked_fill(~owned, 0);
    // One collective for both sums.
    torch::Tensor sums =
        AllReduceSum(torch::stack({exp.sum(-1), target_logit}), *tp,
                     "VocabParallelTargetLogprobs sum all_reduce");
    torch::Tensor sum_exp = sums[0];
    torch::Tensor global_target_logit = sums[1];

    ctx->save_for_backward(
        {exp.div_(sum_exp.unsqueeze(-1)), local_index, owned});
    return global_target_logit - global_max - sum_exp.log();
  }

  static variable_list backward(AutogradContext* ctx,
                                variable_list grad_outputs) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& softmax = saved[0];
    const torch::Tensor& local_index = saved[1];
    const torch::Tensor& owned = saved[2];
    const torch::Tensor g = grad_outputs[0].unsqueeze(-1);
    torch::Tensor onehot_minus_softmax = softmax.neg().scatter_add(
        -1, local_index, owned.to(softmax.scalar_type()).unsqueeze(-1));
    return {g * onehot_minus_softmax, torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

// t [..., D] as a matrix [rows, D] (a view when the layout allows).
torch::Tensor Rows(const torch::Tensor& t) {
  return t.reshape({-1, t.size(-1)});
}

// `rows` [prod(lead), out] back to lead's leading dims: [..., out].
torch::Tensor Unrows(const torch::Tensor& rows, const torch::Tensor& lead) {
  std::vector<int64_t> sizes = lead.sizes().vec();
  sizes.back() = rows.size(1);
  return rows.view(sizes);
}

// a [M, K] @ b [K, N] with the sums in SumType (float32 for bfloat16), the
// result in that dtype: two bfloat16 CPU operands through oneDNN (exact
// products, float32 sums) when the build has it, any others widened first.
torch::Tensor WideMatmul(const torch::Tensor& a, const torch::Tensor& b) {
  if (HasBf16ToFloat32Matmul() && a.scalar_type() == torch::kBFloat16 &&
      b.scalar_type() == torch::kBFloat16 && a.is_cpu() && b.is_cpu()) {
    return ValueOrThrow(MatmulBf16ToFloat32(a, b), "tensor-parallel matmul");
  }
  const torch::ScalarType wide =
      torch::promote_types(SumType(a.scalar_type()), SumType(b.scalar_type()));
  return a.to(wide).mm(b.to(wide));
}

class ColumnParallelLinearFunction
    : public torch::autograd::Function<ColumnParallelLinearFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w,
                               const c10::optional<torch::Tensor>& bias,
                               torch::ScalarType out_type,
                               Communicator* weight_tp_sum) {
    ctx->save_for_backward({x, w, bias.value_or(torch::Tensor())});
    SaveGroup(ctx, weight_tp_sum);
    // x holds w-dtype values (its float32 widening): the cast is exact. The
    // bias joins the float32 sum, which is rounded once to w's dtype.
    torch::Tensor y = WideMatmul(Rows(x).to(w.scalar_type()), w.t());
    if (bias.has_value()) y.add_(*bias);
    return Unrows(y.to(w.scalar_type()), x).to(out_type);
  }

  static variable_list backward(AutogradContext* ctx,
                                variable_list grad_outputs) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    const torch::Tensor& bias = saved[2];
    const torch::Tensor g = Rows(grad_outputs[0]);
    torch::Tensor grad_x = Unrows(WideMatmul(g, w), x);
    torch::Tensor grad_w = WideMatmul(g.t(), Rows(x).to(g.scalar_type()));
    Communicator* weight_tp_sum = SavedOptionalGroup(ctx);
    if (weight_tp_sum != nullptr) {
      grad_w = AllReduceSum(grad_w, *weight_tp_sum,
                            "ColumnParallelLinear weight all_reduce");
    }
    torch::Tensor grad_bias;
    if (bias.defined()) {
      grad_bias = g.to(SumType(g.scalar_type())).sum(0).to(bias.scalar_type());
    }
    return {grad_x, grad_w.to(w.scalar_type()), grad_bias, torch::Tensor(),
            torch::Tensor()};
  }
};

class RowParallelLinearFunction
    : public torch::autograd::Function<RowParallelLinearFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    return Unrows(WideMatmul(Rows(x), w.t()), x);
  }

  static variable_list backward(AutogradContext* ctx,
                                variable_list grad_outputs) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    const torch::Tensor g = Rows(grad_outputs[0]).to(w.scalar_type());
    return {Unrows(WideMatmul(g, w).to(x.scalar_type()), x),
            WideMatmul(g.t(), Rows(x)).to(w.scalar_type())};
  }
};

void CheckLinear(const torch::Tensor& x, const torch::Tensor& w,
                 torch::ScalarType x_type, const char* op) {
  TORCH_CHECK(x.defined() && x.is_floating_point() && w.defined() &&
                  w.is_floating_point(),
              op, ": x and w must be floating-point tensors");
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), op,
              ": x ", x.sizes(), " does not match the weight ", w.sizes(),
              " ([out, in])");
  TORCH_CHECK(x.scalar_type() == x_type, op, ": x must be ", x_type, " for a ",
              w.scalar_type(), " weight, got ", x.scalar_type());
}

}  // namespace

int64_t ShardRows(int64_t full_dim0, int size) {
  TORCH_CHECK(size > 0, "ShardRows: size must be positive, got ", size);
  TORCH_CHECK(full_dim0 >= 0, "ShardRows: full_dim0 must be >= 0, got ",
              full_dim0);
  return (full_dim0 + size - 1) / size;
}

torch::Tensor ShardDim0(const torch::Tensor& full, int rank, int size) {
  TORCH_CHECK(full.dim() >= 1, "ShardDim0: full must have a dim 0");
  TORCH_CHECK(rank >= 0 && rank < size, "ShardDim0: rank ", rank,
              " outside [0, ", size, ")");
  const int64_t full_dim0 = full.size(0);
  const int64_t rows = ShardRows(full_dim0, size);
  const int64_t start = std::min<int64_t>(rank * rows, full_dim0);
  const int64_t present = std::min<int64_t>(rows, full_dim0 - start);
  std::vector<int64_t> padding_sizes = full.sizes().vec();
  padding_sizes[0] = rows - present;
  return torch::cat({full.narrow(0, start, present),
                     torch::zeros(padding_sizes, full.options())},
                    0);
}

torch::Tensor GatherShardedParameter(const torch::Tensor& shard,
                                     int64_t full_dim0, Communicator& group,
                                     std::optional<torch::ScalarType> compute) {
  CheckFloating(shard, "GatherShardedParameter: shard");
  TORCH_CHECK(shard.dim() >= 1,
              "GatherShardedParameter: shard must have a dim 0");
  TORCH_CHECK(full_dim0 >= 1,
              "GatherShardedParameter: full_dim0 must be >= 1, got ",
              full_dim0);
  const int64_t rows = ShardRows(full_dim0, group.size());
  TORCH_CHECK(shard.size(0) == rows, "GatherShardedParameter: shard has ",
              shard.size(0), " rows but full_dim0 ", full_dim0, " over ",
              group.size(), " ranks needs ", rows);
  return GatherShardedParameterFunction::apply(
      shard, full_dim0, &group, compute.value_or(shard.scalar_type()));
}

torch::Tensor UseGatheredCopy(const torch::Tensor& shard, GatheredCopy& copy,
                              Communicator& group, Communicator* tp_sum) {
  CheckFloating(shard, "UseGatheredCopy: shard");
  CheckFloating(copy.value, "UseGatheredCopy: copy.value");
  TORCH_CHECK(shard.dim() >= 1 && copy.value.dim() == shard.dim() &&
                  shard.size(0) == ShardRows(copy.value.size(0), group.size()),
              "UseGatheredCopy: a shard of ", shard.sizes(), " over ",
              group.size(), " ranks does not match the copy's ",
              copy.value.sizes());
  return UseGatheredCopyFunction::apply(shard, &copy, &group, tp_sum);
}

torch::Tensor GatherSequenceBlocks(const torch::Tensor& x,
                                   Communicator& group) {
  CheckFloating(x, "GatherSequenceBlocks: x");
  TORCH_CHECK(x.dim() == 4,
              "GatherSequenceBlocks: x must be [B, H, T, D], got ", x.sizes());
  // The sequence goes to dim 0, where the parameter gather concatenates; the
  // blocks are equal, so the gather pads nothing.
  torch::Tensor blocks = GatherShardedParameter(
      x.permute({2, 0, 1, 3}).contiguous(), x.size(2) * group.size(), group);
  return blocks.permute({1, 2, 0, 3});
}

torch::Tensor ReduceScatterRows(const torch::Tensor& x, Communicator& group) {
  CheckFloating(x, "ReduceScatterRows: x");
  TORCH_CHECK(x.dim() >= 1 && x.size(0) % group.size() == 0,
              "ReduceScatterRows: x ", x.sizes(),
              " must have rows divisible by ", group.size());
  return ReduceScatterRowsFunction::apply(x, &group);
}

torch::Tensor CopyToTensorParallelRegion(const torch::Tensor& x,
                                         Communicator& tp) {
  CheckFloating(x, "CopyToTensorParallelRegion: x");
  return CopyToTensorParallelRegionFunction::apply(x, &tp);
}

torch::Tensor ReduceFromTensorParallelRegion(const torch::Tensor& x,
                                             Communicator& tp) {
  CheckFloating(x, "ReduceFromTensorParallelRegion: x");
  return ReduceFromTensorParallelRegionFunction::apply(x, &tp);
}

torch::Tensor VocabParallelEmbedding(const torch::Tensor& ids,
                                     const torch::Tensor& weight_shard,
                                     int64_t vocab_start, Communicator& tp) {
  CheckFloating(weight_shard, "VocabParallelEmbedding: weight_shard");
  TORCH_CHECK(weight_shard.dim() == 2,
              "VocabParallelEmbedding: weight_shard must be [rows, D], got ",
              weight_shard.sizes());
  TORCH_CHECK(ids.scalar_type() == torch::kLong,
              "VocabParallelEmbedding: ids must be int64");
  const int64_t rows = weight_shard.size(0);
  const torch::Tensor owned = (ids >= vocab_start) & (ids < vocab_start + rows);
  const torch::Tensor local_ids = (ids - vocab_start).masked_fill(~owned, 0);
  torch::Tensor partial = torch::embedding(weight_shard, local_ids)
                              .masked_fill(~owned.unsqueeze(-1), 0);
  return ReduceFromTensorParallelRegion(partial, tp);
}

torch::Tensor VocabParallelTargetLogprobs(const torch::Tensor& logits_shard,
                                          const torch::Tensor& targets,
                                          int64_t vocab_start,
                                          Communicator& tp) {
  CheckFloating(logits_shard, "VocabParallelTargetLogprobs: logits_shard");
  TORCH_CHECK(targets.scalar_type() == torch::kLong,
              "VocabParallelTargetLogprobs: targets must be int64");
  TORCH_CHECK(
      logits_shard.dim() == targets.dim() + 1 &&
          logits_shard.sizes().slice(0, targets.dim()) == targets.sizes(),
      "VocabParallelTargetLogprobs: logits_shard ", logits_shard.sizes(),
      " must be targets ", targets.sizes(), " plus a vocab dim");
  const int64_t local_vocab = logits_shard.size(-1);
  const int64_t vocab = local_vocab * tp.size();
  TORCH_CHECK(local_vocab >= 1 && vocab_start >= 0 &&
                  vocab_start + local_vocab <= vocab,
              "VocabParallelTargetLogprobs: vocab_start ", vocab_start,
              " with ", local_vocab, " local columns is outside vocab ", vocab);
  if (targets.numel() > 0) {
    TORCH_CHECK(targets.min().item<int64_t>() >= 0 &&
                    targets.max().item<int64_t>() < vocab,
                "VocabParallelTargetLogprobs: targets must lie in [0, ", vocab,
                ")");
  }
  return VocabParallelTargetLogprobsFunction::apply(logits_shard, targets,
                                                    vocab_start, &tp);
}

torch::Tensor ColumnParallelLinear(const torch::Tensor& x,
                                   const torch::Tensor& w,
                                   torch::ScalarType out_type,
                                   const torch::Tensor& bias,
                                   Communicator* weight_tp_sum) {
  CheckLinear(x, w, SumType(w.scalar_type()), "ColumnParallelLinear");
  TORCH_CHECK(!bias.defined() || (bias.is_floating_point() && bias.dim() == 1 &&
                                  bias.size(0) == w.size(0)),
              "ColumnParallelLinear: bias ",
              bias.defined() ? bias.sizes() : c10::IntArrayRef{},
              " must be a floating-point [", w.size(0), "] for the weight ",
              w.sizes());
  // An undefined tensor cannot be a Function's input; an empty optional can.
  return ColumnParallelLinearFunction::apply(
      x, w, bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt,
      out_type, weight_tp_sum);
}

torch::Tensor RowParallelLinear(const torch::Tensor& x,
                                const torch::Tensor& w) {
  CheckLinear(x, w, w.scalar_type(), "RowParallelLinear");
  return RowParallelLinearFunction::apply(x, w);
}

absl::StatusOr<torch::Tensor> GatherVocabShards(const torch::Tensor& shard,
                                                Communicator& tp) {
  // AllGather concatenates along dim 0: move the vocabulary there and back.
  TALLY_ASSIGN_OR_RETURN(torch::Tensor gathered,
                         tp.AllGather(shard.movedim(-1, 0).contiguous()));
  return gathered.movedim(0, -1).contiguous();
}

}  // namespace tally
