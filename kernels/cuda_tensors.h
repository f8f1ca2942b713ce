// The fused optimizer updates and gradient statistics over CUDA tensors: the
// device half of the tensor-level entries of kernels/fused_optimizer.h and
// kernels/grad_stats.h, which send CUDA tensors here and CPU tensors to the
// CPU kernels. Callers use those entries; this header is their seam.
//
// Each call groups its tensors by dtype and runs the raw-pointer CUDA kernels
// (kernels/cuda/) once per group on the device's current stream, so a step
// is one launch per dtype whatever the number of parameters. The updates are
// asynchronous on that stream; the statistics are reduced on the device and
// only their few result scalars are copied to the host.
//
// Only a build whose LibTorch has CUDA (TALLY_TORCH_CUDA) and whose CUDA
// kernels are built (TALLY_CUDA_KERNELS) can run them; any other build
// answers FAILED_PRECONDITION saying which is missing.
//
//   TALLY_RETURN_IF_ERROR(tally::kernels::CudaTensorSupport());
//   // every operand contiguous, on one CUDA device (CheckFusable):
//   TALLY_RETURN_IF_ERROR(tally::kernels::FusedAdamWCudaTensors(tensors, hp));
#ifndef TALLY_KERNELS_CUDA_TENSORS_H_
#define TALLY_KERNELS_CUDA_TENSORS_H_

#include <torch/torch.h>

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/optimizer_math.h"
#include "kernels/tensor_operands.h"

namespace tally::kernels {

// OK when this build can run the kernels on CUDA tensors; FAILED_PRECONDITION
// naming what the build lacks otherwise.
absl::Status CudaTensorSupport();

// The updates of FusedAdamW / FusedSgd for entries that already passed
// CheckFusable and share one CUDA device. INTERNAL naming the CUDA error when
// a launch fails.
absl::Status FusedAdamWCudaTensors(const std::vector<UpdateOperands>& tensors,
                                   const UpdateHyperparameters& hp);
absl::Status FusedSgdCudaTensors(const std::vector<UpdateOperands>& tensors,
                                 const UpdateHyperparameters& hp);

// MultiTensorGradStats over float32 / float64 tensors of one CUDA device
// (undefined tensors count as empty; non-contiguous ones are read through a
// contiguous copy). Blocks until the result is on the host.
absl::StatusOr<GradStats> GradStatsCudaTensors(
    const std::vector<torch::Tensor>& tensors);

}  // namespace tally::kernels

#endif  // TALLY_KERNELS_CUDA_TENSORS_H_
