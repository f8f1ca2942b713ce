// Multi-tensor gradient statistics in one sweep: the fp64 sum of squares, the
// largest magnitude and a non-finite flag, over a list of tensors: CPU
// tensors here, CUDA tensors on the device (kernels/cuda_tensors.h), with
// only the result copied back.
//
// Squares are accumulated in fp64 whatever the tensor dtype, so fp32
// gradients near 1e20 (whose squares overflow fp32) still give a finite norm.
// Work is split into fixed-size chunks whose partial sums are combined in
// chunk order, so the result is bitwise identical for any thread count.
//
//   tally::kernels::GradStats stats =
//       tally::kernels::MultiTensorGradStats({g1, g2});
//   double l2 = std::sqrt(stats.sum_squares);
#ifndef TALLY_KERNELS_GRAD_STATS_H_
#define TALLY_KERNELS_GRAD_STATS_H_

#include <torch/torch.h>

#include <vector>

#include "kernels/tensor_operands.h"

namespace tally::kernels {

// Tensors must be float32 or float64, all on the CPU or all on one CUDA
// device; non-contiguous tensors are read through a contiguous copy;
// undefined tensors count as empty. Throws c10::Error otherwise, and for CUDA
// tensors in a build that cannot read them (kernels::CudaTensorSupport). On
// CUDA the result is exact to ~1e-12 relative of the CPU's (another
// summation order), bitwise reproducible on one GPU.
GradStats MultiTensorGradStats(const std::vector<torch::Tensor>& tensors);

}  // namespace tally::kernels

#endif  // TALLY_KERNELS_GRAD_STATS_H_
