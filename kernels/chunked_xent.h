// Chunked target log-probabilities: log softmax(hidden @ weightᵀ)[target] for
// every token, computed over chunks of tokens so that the float32 logits of
// the whole call [tokens, vocab] never exist at once. The language-model head
// uses it (runtime/model/llama_model.cc) in place of Logits -> log_softmax ->
// gather: per chunk, the logits (the head's product in the weight's dtype,
// widened to float32 at least, as the composed path does), their log-softmax
// and the targets' entries; only the [tokens] result is kept.
//
// As a LibTorch autograd function whose backward recomputes each chunk's
// logits (one more head product per chunk) and forms the chunk's logit
// gradient, g * (onehot(target) - softmax), then grad_hidden rows and the
// chunk's share of grad_weight, which is summed over chunks in float32 at
// least (bf16 x bf16 products go through MatmulBf16ToFloat32 where the build
// has it) and rounded to the weight's dtype once.
//
// Numerics: each chunk runs the composed ops on its rows, so the forward is
// the composed path's to within the head product's row blocking (bitwise in
// practice); grad_hidden the same; grad_weight differs by the order of its
// sum over tokens (fp64: within 1e-12, kernels/chunked_xent_test.cc).
//
//   // hidden [B, T, H] (the final norm's output), weight [V, H], targets
//   // [B, T] int64 in [0, V):
//   torch::Tensor logprobs =
//       tally::kernels::ChunkedTargetLogprobs(hidden, weight, targets);
//   // logprobs [B, T], float32 (float64 for a float64 model).
#ifndef TALLY_KERNELS_CHUNKED_XENT_H_
#define TALLY_KERNELS_CHUNKED_XENT_H_

#include <torch/torch.h>

#include <cstdint>

namespace tally::kernels {

// The logits of one chunk hold about this many elements (32 MB in float32):
// 262 tokens of a 32000-token vocabulary.
inline constexpr int64_t kXentChunkElements = int64_t{1} << 23;

// log_softmax(hidden @ weightᵀ, -1) gathered at `targets`, shaped like
// targets, in float32 (float64 when hidden is float64). hidden [..., H] and
// weight [V, H] share a floating dtype and device; targets are int64 in
// [0, V) with hidden's leading dims. chunk_rows: tokens per chunk (0: about
// kXentChunkElements logits per chunk). Throws c10::Error naming the operand
// for bad input.
torch::Tensor ChunkedTargetLogprobs(const torch::Tensor& hidden,
                                    const torch::Tensor& weight,
                                    const torch::Tensor& targets,
                                    int64_t chunk_rows = 0);

// The unchunked path ChunkedTargetLogprobs replaces, for its tests and
// bench: the whole call's logits widened to float32 at least, log_softmax,
// gather. Same operands and result.
torch::Tensor ComposedTargetLogprobs(const torch::Tensor& hidden,
                                     const torch::Tensor& weight,
                                     const torch::Tensor& targets);

}  // namespace tally::kernels

#endif  // TALLY_KERNELS_CHUNKED_XENT_H_
