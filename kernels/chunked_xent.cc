#include "kernels/chunked_xent.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

#include "kernels/onednn_matmul.h"

namespace tally::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// The dtype the logits and their statistics are computed in.
torch::ScalarType Wide(torch::ScalarType type) {
  return type == torch::kDouble ? torch::kDouble : torch::kFloat;
}

// One chunk's logits [n, V] in float32 at least: the head's product in the
// operands' dtype, then widened (the composed path's Logits).
torch::Tensor ChunkLogits(const torch::Tensor& hidden,
                          const torch::Tensor& weight) {
  return torch::linear(hidden, weight).to(Wide(weight.scalar_type()));
}

// acc (float32 at least) += a @ b: in place when a and b already have acc's
// dtype; bf16 x bf16 keeps its float32 accumulator where the build can
// (MatmulBf16ToFloat32), else its product is rounded to bf16 first.
void AccumulateProduct(torch::Tensor& acc, const torch::Tensor& a,
                       const torch::Tensor& b) {
  if (a.scalar_type() == acc.scalar_type()) {
    acc.addmm_(a, b);
  } else if (a.scalar_type() == torch::kBFloat16 && a.is_cpu() &&
             HasBf16ToFloat32Matmul()) {
    absl::StatusOr<torch::Tensor> product = MatmulBf16ToFloat32(a, b);
    TORCH_CHECK(product.ok(),
                "ChunkedTargetLogprobs: ", product.status().ToString());
    acc.add_(*product);
  } else {
    acc.add_(torch::mm(a, b));
  }
}

class ChunkedTargetLogprobsFunction
    : public torch::autograd::Function<ChunkedTargetLogprobsFunction> {
 public:
  // hidden [N, H], weight [V, H], targets [N]: the log-probabilities [N].
  static torch::Tensor forward(AutogradContext* ctx,
                               const torch::Tensor& hidden,
                               const torch::Tensor& weight,
                               const torch::Tensor& targets,
                               int64_t chunk_rows) {
    const int64_t tokens = hidden.size(0);
    torch::Tensor out = torch::empty(
        {tokens}, hidden.options().dtype(Wide(hidden.scalar_type())));
    for (int64_t start = 0; start < tokens; start += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, tokens - start);
      const torch::Tensor picked = targets.narrow(0, start, rows).unsqueeze(1);
      out.narrow(0, start, rows)
          .copy_(torch::log_softmax(
                     ChunkLogits(hidden.narrow(0, start, rows), weight), -1)
                     .gather(1, picked)
                     .squeeze(1));
    }
    ctx->save_for_backward({hidden, weight, targets});
    ctx->saved_data["chunk_rows"] = chunk_rows;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const tensor_list saved = ctx->get_saved_variables();
    const torch::Tensor &hidden = saved[0], &weight = saved[1],
                        &targets = saved[2];
    const int64_t chunk_rows = ctx->saved_data["chunk_rows"].toInt();
    const bool want_hidden = ctx->needs_input_grad(0);
    const bool want_weight = ctx->needs_input_grad(1);
    const torch::Tensor grad_out = grads[0].to(Wide(hidden.scalar_type()));
    const int64_t tokens = hidden.size(0);
    torch::Tensor grad_hidden, grad_weight;
    if (want_hidden) grad_hidden = torch::empty_like(hidden);
    if (want_weight) {
      grad_weight = torch::zeros(
          weight.sizes(), weight.options().dtype(Wide(weight.scalar_type())));
    }
    for (int64_t start = 0; start < tokens && (want_hidden || want_weight);
         start += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, tokens - start);
      const torch::Tensor h = hidden.narrow(0, start, rows);
      const torch::Tensor g = grad_out.narrow(0, start, rows).unsqueeze(1);
      // d logprob / d logits = onehot(target) - softmax, times g; as the
      // composed backward, g - softmax * g at the target.
      torch::Tensor grad_logits =
          torch::log_softmax(ChunkLogits(h, weight), -1).exp_().mul_(-g);
      grad_logits.scatter_add_(1, targets.narrow(0, start, rows).unsqueeze(1),
                               g);
      // The widening's backward: back to the operands' dtype.
      grad_logits = grad_logits.to(weight.scalar_type());
      if (want_hidden) {
        grad_hidden.narrow(0, start, rows)
            .copy_(torch::mm(grad_logits, weight));
      }
      if (want_weight) AccumulateProduct(grad_weight, grad_logits.t(), h);
    }
    if (want_weight) grad_weight = grad_weight.to(weight.scalar_type());
    return {grad_hidden, grad_weight, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor ChunkedTargetLogprobs(const torch::Tensor& hidden,
                                    const torch::Tensor& weight,
                                    const torch::Tensor& targets,
                                    int64_t chunk_rows) {
  TORCH_CHECK(hidden.dim() >= 1 && weight.dim() == 2 &&
                  hidden.size(-1) == weight.size(1),
              "ChunkedTargetLogprobs: hidden [..., H] and weight [V, H] "
              "must share H, got ",
              hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(at::isFloatingType(hidden.scalar_type()) &&
                  hidden.scalar_type() == weight.scalar_type() &&
                  hidden.device() == weight.device(),
              "ChunkedTargetLogprobs: hidden and weight must share a floating "
              "dtype and device, got ",
              hidden.scalar_type(), " on ", hidden.device(), " and ",
              weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK(targets.scalar_type() == torch::kInt64 &&
                  targets.sizes() == hidden.sizes().slice(0, hidden.dim() - 1),
              "ChunkedTargetLogprobs: targets must be int64 shaped ",
              hidden.sizes().slice(0, hidden.dim() - 1), ", got ",
              targets.scalar_type(), " ", targets.sizes());
  TORCH_CHECK(chunk_rows >= 0, "ChunkedTargetLogprobs: chunk_rows must be >= 0",
              ", got ", chunk_rows);
  const int64_t vocab = weight.size(0);
  const torch::Tensor flat_targets = targets.reshape({-1}).to(hidden.device());
  if (flat_targets.numel() > 0) {
    TORCH_CHECK(flat_targets.min().item<int64_t>() >= 0 &&
                    flat_targets.max().item<int64_t>() < vocab,
                "ChunkedTargetLogprobs: targets must lie in [0, ", vocab, ")");
  }
  if (chunk_rows == 0) {
    chunk_rows =
        std::max<int64_t>(1, kXentChunkElements / std::max<int64_t>(vocab, 1));
  }
  const torch::Tensor out = ChunkedTargetLogprobsFunction::apply(
      hidden.reshape({-1, hidden.size(-1)}), weight, flat_targets, chunk_rows);
  return out.view(targets.sizes());
}

torch::Tensor ComposedTargetLogprobs(const torch::Tensor& hidden,
                                     const torch::Tensor& weight,
                                     const torch::Tensor& targets) {
  return torch::log_softmax(ChunkLogits(hidden, weight), -1)
      .gather(-1, targets.unsqueeze(-1))
      .squeeze(-1);
}

}  // namespace tally::kernels
