// CUDA multi-tensor gradient statistics: the fp64 sum of squares, the largest
// magnitude and a non-finite flag over many device buffers, in two launches
// whatever the number of tensors. The CUDA counterpart of
// kernels/grad_stats.h, with the same NaN / Inf rules.
//
// Plain C++ with no LibTorch (the LibTorch build here is CPU-only), so callers
// pass raw device pointers. Every tensor is cut into fixed-size chunks listed
// in one table; one block per chunk writes an fp64 partial, and a single block
// folds the partials in a fixed order, so results are bitwise reproducible.
// The call is asynchronous on `stream` and writes `*result` in device memory.
//
//   const float* grads[] = {d_weight, d_bias};  // device pointers
//   const int64_t sizes[] = {4096 * 4096, 4096};
//   tally::kernels::CudaGradStats* d_result;    // device memory
//   cudaMalloc(&d_result, sizeof(*d_result));
//   cudaError_t error = tally::kernels::GradStatsCuda(grads, sizes, 2,
//                                                     d_result, stream);
//   tally::kernels::CudaGradStats stats;
//   cudaMemcpyAsync(&stats, d_result, sizeof(stats), cudaMemcpyDeviceToHost,
//                   stream);
//   cudaStreamSynchronize(stream);
#ifndef TALLY_KERNELS_CUDA_GRAD_STATS_CUDA_H_
#define TALLY_KERNELS_CUDA_GRAD_STATS_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tally::kernels {

struct CudaGradStats {
  double sum_squares;  // NaN if any element is NaN
  double max_abs;      // NaN if any element is NaN
  int nonfinite;       // 1 if any element is NaN or Inf, else 0
};

// `tensors` and `sizes` are host arrays of `num_tensors` entries; each
// tensors[i] is a device buffer of sizes[i] contiguous elements (it may be
// null when sizes[i] is 0). Scratch memory comes from cudaMallocAsync on
// `stream`. Returns cudaErrorInvalidValue for a negative count or size, a
// null buffer with a non-zero size, or a null `result`.
cudaError_t GradStatsCuda(const float* const* tensors, const int64_t* sizes,
                          int num_tensors, CudaGradStats* result,
                          cudaStream_t stream);
cudaError_t GradStatsCuda(const double* const* tensors, const int64_t* sizes,
                          int num_tensors, CudaGradStats* result,
                          cudaStream_t stream);

}  // namespace tally::kernels

#endif  // TALLY_KERNELS_CUDA_GRAD_STATS_CUDA_H_
