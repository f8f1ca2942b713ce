// CUDA fused optimizer updates: the AdamW and SGD steps of
// kernels/fused_optimizer.h over many device buffers in one launch, with the
// same per-element arithmetic (kernels/optimizer_math.h, compiled with
// -fmad=false so only its explicit fmas fuse) and so the same results as the
// CPU kernels and the composed LibTorch path.
//
// Plain C++ with no LibTorch (the LibTorch build here is CPU-only), so callers
// pass raw device pointers, as for GradStatsCuda. Every tensor is cut into
// fixed-size chunks listed in one table, one block per chunk. Gradients are
// read as grad * hp.grad_scale and never written. The call is asynchronous on
// `stream`.
//
//   float* params[] = {d_w, d_b};       // device pointers
//   const float* grads[] = {d_gw, d_gb};
//   float* exp_avgs[] = {d_mw, d_mb};
//   float* exp_avg_sqs[] = {d_vw, d_vb};
//   const int64_t sizes[] = {4096 * 4096, 4096};
//   tally::kernels::UpdateHyperparameters hp;
//   hp.step = 1;
//   hp.grad_scale = clip_coef / num_tokens;
//   cudaError_t error = tally::kernels::FusedAdamWCuda(
//       params, grads, exp_avgs, exp_avg_sqs, sizes, 2, hp, stream);
#ifndef TALLY_KERNELS_CUDA_FUSED_OPTIMIZER_CUDA_H_
#define TALLY_KERNELS_CUDA_FUSED_OPTIMIZER_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/optimizer_math.h"

namespace tally::kernels {

// Pointer arguments are host arrays of `num_tensors` entries naming device
// buffers of sizes[i] contiguous elements (null allowed when sizes[i] is 0);
// the buffers of one entry must not overlap. Scratch memory comes from
// cudaMallocAsync on `stream`. Returns cudaErrorInvalidValue, before any work
// is queued, for a negative count or size or a null buffer with a non-zero
// size.
cudaError_t FusedAdamWCuda(float* const* params, const float* const* grads,
                           float* const* exp_avgs, float* const* exp_avg_sqs,
                           const int64_t* sizes, int num_tensors,
                           const UpdateHyperparameters& hp,
                           cudaStream_t stream);
cudaError_t FusedAdamWCuda(double* const* params, const double* const* grads,
                           double* const* exp_avgs, double* const* exp_avg_sqs,
                           const int64_t* sizes, int num_tensors,
                           const UpdateHyperparameters& hp,
                           cudaStream_t stream);

// SGD: only learning_rate, weight_decay and grad_scale of `hp` are used.
cudaError_t FusedSgdCuda(float* const* params, const float* const* grads,
                         const int64_t* sizes, int num_tensors,
                         const UpdateHyperparameters& hp, cudaStream_t stream);
cudaError_t FusedSgdCuda(double* const* params, const double* const* grads,
                         const int64_t* sizes, int num_tensors,
                         const UpdateHyperparameters& hp, cudaStream_t stream);

}  // namespace tally::kernels

#endif  // TALLY_KERNELS_CUDA_FUSED_OPTIMIZER_CUDA_H_
