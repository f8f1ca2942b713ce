#include "runtime/model/blocked_attention.h"

#include <cmath>
#include <limits>

#include "runtime/model/causal_lm.h"

namespace tally {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

constexpr double kInf = std::numeric_limits<double>::infinity();

// One block of keys [begin, end) and the layout's rule for it.
struct KeyBlock {
  int64_t begin = 0;
  int64_t end = 0;
};

// [B, 1, T, b]: true where a query must not see a key of the block.
torch::Tensor BlockMask(const AttentionLayout& layout, int64_t window,
                        KeyBlock block) {
  return (~layout.VisibleKeys(window, block.begin, block.end)).unsqueeze(1);
}

// The block's scaled, masked scores [B, H, T, b] in the accumulation type.
torch::Tensor BlockScores(const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& mask, KeyBlock block) {
  const double scale = std::sqrt(static_cast<double>(q.size(-1)));
  return (torch::matmul(q, k.slice(2, block.begin, block.end).transpose(-2, -1))
              .to(AtLeastFloat32(q.scalar_type())) /
          scale)
      .masked_fill(mask, -kInf);
}

class BlockedAttentionFunction
    : public torch::autograd::Function<BlockedAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& positions,
                               const torch::Tensor& key_positions,
                               const torch::Tensor& key_valid, int64_t window,
                               int64_t block_keys) {
    const AttentionLayout layout{positions, key_positions, key_valid};
    const torch::ScalarType acc = AtLeastFloat32(q.scalar_type());
    const auto stats = q.options().dtype(acc);
    const int64_t batch = q.size(0), heads = q.size(1), seq = q.size(2);
    // The running maximum m, sum l and unnormalized output o per query.
    torch::Tensor m = torch::full({batch, heads, seq}, -kInf, stats);
    torch::Tensor l = torch::zeros({batch, heads, seq}, stats);
    torch::Tensor o = torch::zeros({batch, heads, seq, v.size(-1)}, stats);
    for (int64_t begin = 0; begin < k.size(2); begin += block_keys) {
      const KeyBlock block{begin, std::min(begin + block_keys, k.size(2))};
      const torch::Tensor s =
          BlockScores(q, k, BlockMask(layout, window, block), block);
      const torch::Tensor m_new = torch::maximum(m, s.amax(-1));
      // A query that has seen no key yet keeps m = -inf: shift by 0 then.
      const torch::Tensor shift =
          torch::where(torch::isinf(m_new), torch::zeros_like(m_new), m_new);
      const torch::Tensor p = torch::exp(s - shift.unsqueeze(-1));
      const torch::Tensor rescale = torch::exp(m - shift);
      l = l * rescale + p.sum(-1);
      o = o * rescale.unsqueeze(-1) +
          torch::matmul(p.to(v.scalar_type()),
                        v.slice(2, block.begin, block.end))
              .to(acc);
      m = m_new;
    }
    const torch::Tensor seen = l > 0;
    const torch::Tensor out =
        (o / torch::where(seen, l, torch::ones_like(l)).unsqueeze(-1))
            .to(q.scalar_type());
    // log-sum-exp per query; +inf where nothing was seen, so every
    // recomputed probability of that query is 0.
    const torch::Tensor lse =
        torch::where(seen, m + torch::log(l), torch::full_like(l, kInf));
    ctx->save_for_backward(
        {q, k, v, out, lse, positions, key_positions, key_valid});
    ctx->saved_data["window"] = window;
    ctx->saved_data["block_keys"] = block_keys;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2],
                        &out = saved[3], &lse = saved[4];
    const int64_t window = ctx->saved_data["window"].toInt();
    const int64_t block_keys = ctx->saved_data["block_keys"].toInt();
    const torch::ScalarType acc = AtLeastFloat32(q.scalar_type());
    const double scale = std::sqrt(static_cast<double>(q.size(-1)));
    const AttentionLayout layout{saved[5], saved[6], saved[7]};
    // Contiguous once, not copied by every block's matmul.
    const torch::Tensor d_out = grads[0].to(q.scalar_type()).contiguous();
    // D_i = sum_j P_ij dP_ij = dO_i . O_i.
    const torch::Tensor delta = (d_out.to(acc) * out.to(acc)).sum(-1);
    torch::Tensor d_q = torch::zeros(q.sizes(), q.options().dtype(acc));
    std::vector<torch::Tensor> d_k, d_v;
    for (int64_t begin = 0; begin < k.size(2); begin += block_keys) {
      const KeyBlock block{begin, std::min(begin + block_keys, k.size(2))};
      const torch::Tensor k_block = k.slice(2, block.begin, block.end);
      const torch::Tensor v_block = v.slice(2, block.begin, block.end);
      const torch::Tensor p = torch::exp(
          BlockScores(q, k, BlockMask(layout, window, block), block) -
          lse.unsqueeze(-1));
      d_v.push_back(
          torch::matmul(p.to(v.scalar_type()).transpose(-2, -1), d_out));
      const torch::Tensor d_p =
          torch::matmul(d_out, v_block.transpose(-2, -1)).to(acc);
      const torch::Tensor d_s =
          (p * (d_p - delta.unsqueeze(-1))).to(q.scalar_type());
      d_q = d_q + torch::matmul(d_s, k_block).to(acc) / scale;
      d_k.push_back(torch::matmul(d_s.transpose(-2, -1), q) / scale);
    }
    return {d_q.to(q.scalar_type()), torch::cat(d_k, 2), torch::cat(d_v, 2),
            torch::Tensor(),         torch::Tensor(),    torch::Tensor(),
            torch::Tensor(),         torch::Tensor()};
  }
};

}  // namespace

torch::Tensor BlockedAttention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v,
                               const AttentionLayout& layout, int64_t window,
                               int64_t block_keys) {
  TORCH_CHECK(block_keys >= 1, "block_keys must be >= 1");
  // Contiguous once (q, k, v arrive as transposed views), not copied by
  // every block's matmul.
  return BlockedAttentionFunction::apply(
      q.contiguous(), k.contiguous(), v.contiguous(), layout.positions,
      layout.key_positions, layout.key_valid, window, block_keys);
}

}  // namespace tally
