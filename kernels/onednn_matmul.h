// bfloat16 x bfloat16 -> float32 matrix products on the CPU, through
// oneDNN's matmul primitive (the library LibTorch's own bfloat16 matmuls run
// in on the CPU).
//
// LibTorch 1.13 rounds a bfloat16 matmul's float32 accumulator to bfloat16
// on the way out, and offers no bfloat16 product with a float32 result. This
// one keeps the accumulator: every product of two bfloat16 values is exact in
// float32 and the sums run in float32, so a caller that adds several partial
// products (the tensor-parallel linears, runtime/parallel/parallel_ops.h)
// rounds once, after the sum, as a single matmul over the whole reduction
// would.
//
// Operands are 2-D views: a transpose is a stride, not a copy (a matrix whose
// rows or columns are contiguous is read in place, any other is copied
// first). Primitives are cached per thread by shape and strides.
//
// Built only against Debian's LibTorch 1.x, which itself links the system
// libdnnl.so.2 (kernels/CMakeLists.txt); with another LibTorch (a PyTorch
// wheel's, which carries its own oneDNN) onednn_matmul_stub.cc stands in:
// HasBf16ToFloat32Matmul() is false and the matmul UNIMPLEMENTED.
//
//   if (!tally::HasBf16ToFloat32Matmul()) { /* take another path */ }
//   torch::Tensor x = ...;  // [M, K] bfloat16, CPU
//   torch::Tensor w = ...;  // [N, K] bfloat16, CPU (a linear's weight)
//   TALLY_ASSIGN_OR_RETURN(torch::Tensor y,
//                          tally::MatmulBf16ToFloat32(x, w.t()));
//   // y: [M, N] float32, x @ w^T summed in float32
#ifndef TALLY_KERNELS_ONEDNN_MATMUL_H_
#define TALLY_KERNELS_ONEDNN_MATMUL_H_

#include <torch/torch.h>

#include "absl/status/statusor.h"

namespace tally {

// Whether this build has the matmul below (false with onednn_matmul_stub.cc).
bool HasBf16ToFloat32Matmul();

// a [M, K] @ b [K, N] as a fresh contiguous float32 [M, N] tensor. a and b
// must be 2-D bfloat16 CPU tensors with matching inner sizes; anything else
// (another dtype, a CUDA tensor, other ranks) is INVALID_ARGUMENT naming the
// operand. A oneDNN failure is INTERNAL; UNIMPLEMENTED when
// !HasBf16ToFloat32Matmul().
absl::StatusOr<torch::Tensor> MatmulBf16ToFloat32(const torch::Tensor& a,
                                                  const torch::Tensor& b);

}  // namespace tally

#endif  // TALLY_KERNELS_ONEDNN_MATMUL_H_
