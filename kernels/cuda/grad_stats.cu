#include <cuda_runtime.h>
#include <math_constants.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "kernels/cuda/chunking.cuh"
#include "kernels/cuda/grad_stats_cuda.h"

namespace tally::kernels {
namespace {

template <typename T>
struct Chunk {
  const T* data;
  int64_t count;
};

struct Partial {
  double sum_squares;
  // Skips NaN: a NaN element shows up as a NaN sum_squares instead.
  double max_abs;
};

// Leaves the block's total sum and max in every thread's arguments, combined
// along a fixed tree so the rounding never depends on scheduling.
__device__ void BlockReduce(double& sum_squares, double& max_abs) {
  __shared__ double sums[kBlockThreads];
  __shared__ double maxes[kBlockThreads];
  const int thread = threadIdx.x;
  sums[thread] = sum_squares;
  maxes[thread] = max_abs;
  __syncthreads();
  for (int stride = kBlockThreads / 2; stride > 0; stride /= 2) {
    if (thread < stride) {
      sums[thread] += sums[thread + stride];
      maxes[thread] = fmax(maxes[thread], maxes[thread + stride]);
    }
    __syncthreads();
  }
  sum_squares = sums[0];
  max_abs = maxes[0];
}

template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    ChunkPartialsKernel(const Chunk<T>* __restrict__ chunks,
                        Partial* __restrict__ partials) {
  const Chunk<T> chunk = chunks[blockIdx.x];
  double sum_squares = 0.0;
  T max_abs = 0;
  for (int64_t i = threadIdx.x; i < chunk.count; i += kBlockThreads) {
    const T x = chunk.data[i];
    const double wide = static_cast<double>(x);
    sum_squares += wide * wide;
    const T magnitude = fabs(x);
    // A NaN magnitude compares false and is skipped.
    max_abs = magnitude > max_abs ? magnitude : max_abs;
  }
  double block_max = static_cast<double>(max_abs);
  BlockReduce(sum_squares, block_max);
  if (threadIdx.x == 0) partials[blockIdx.x] = {sum_squares, block_max};
}

__global__ void __launch_bounds__(kBlockThreads)
    FinalizeKernel(const Partial* __restrict__ partials, int num_partials,
                   CudaGradStats* __restrict__ result) {
  double sum_squares = 0.0;
  double max_abs = 0.0;
  for (int i = threadIdx.x; i < num_partials; i += kBlockThreads) {
    sum_squares += partials[i].sum_squares;
    max_abs = fmax(max_abs, partials[i].max_abs);
  }
  BlockReduce(sum_squares, max_abs);
  if (threadIdx.x == 0) {
    // Squares are >= 0 or +Inf, so the sum is NaN only through a NaN element,
    // and the NaN-skipping max is Inf only through an Inf element.
    const bool has_nan = isnan(sum_squares);
    result->sum_squares = sum_squares;
    result->max_abs = has_nan ? CUDART_NAN : max_abs;
    result->nonfinite = has_nan || isinf(max_abs) ? 1 : 0;
  }
}

template <typename T>
cudaError_t LaunchGradStats(const T* const* tensors, const int64_t* sizes,
                            int num_tensors, CudaGradStats* result,
                            cudaStream_t stream) {
  if (num_tensors < 0 || result == nullptr ||
      (num_tensors > 0 && (tensors == nullptr || sizes == nullptr))) {
    return cudaErrorInvalidValue;
  }
  std::vector<Chunk<T>> chunks;
  for (int i = 0; i < num_tensors; ++i) {
    if (sizes[i] < 0 || (sizes[i] > 0 && tensors[i] == nullptr)) {
      return cudaErrorInvalidValue;
    }
    for (int64_t begin = 0; begin < sizes[i]; begin += kChunkElements) {
      chunks.push_back(
          {tensors[i] + begin, std::min(kChunkElements, sizes[i] - begin)});
    }
  }
  // Grid size and FinalizeKernel's loop index are ints.
  if (chunks.size() > static_cast<size_t>(INT_MAX)) {
    return cudaErrorInvalidValue;
  }
  const int num_chunks = static_cast<int>(chunks.size());

  // One scratch allocation: the partials, then the chunk table.
  void* workspace = nullptr;
  Partial* partials = nullptr;
  if (num_chunks > 0) {
    const size_t partial_bytes = chunks.size() * sizeof(Partial);
    const size_t table_bytes = chunks.size() * sizeof(Chunk<T>);
    cudaError_t error =
        cudaMallocAsync(&workspace, partial_bytes + table_bytes, stream);
    if (error != cudaSuccess) return error;
    partials = static_cast<Partial*>(workspace);
    auto* table = reinterpret_cast<Chunk<T>*>(static_cast<char*>(workspace) +
                                              partial_bytes);
    // From pageable memory the copy is staged before the call returns, so
    // `chunks` may be destroyed while the copy is still in flight.
    error = cudaMemcpyAsync(table, chunks.data(), table_bytes,
                            cudaMemcpyHostToDevice, stream);
    if (error == cudaSuccess) {
      ChunkPartialsKernel<T>
          <<<num_chunks, kBlockThreads, 0, stream>>>(table, partials);
      error = cudaGetLastError();
    }
    if (error != cudaSuccess) {
      cudaFreeAsync(workspace, stream);
      return error;
    }
  }
  FinalizeKernel<<<1, kBlockThreads, 0, stream>>>(partials, num_chunks, result);
  cudaError_t error = cudaGetLastError();
  if (workspace != nullptr) {
    const cudaError_t free_error = cudaFreeAsync(workspace, stream);
    if (error == cudaSuccess) error = free_error;
  }
  return error;
}

}  // namespace

cudaError_t GradStatsCuda(const float* const* tensors, const int64_t* sizes,
                          int num_tensors, CudaGradStats* result,
                          cudaStream_t stream) {
  return LaunchGradStats(tensors, sizes, num_tensors, result, stream);
}

cudaError_t GradStatsCuda(const double* const* tensors, const int64_t* sizes,
                          int num_tensors, CudaGradStats* result,
                          cudaStream_t stream) {
  return LaunchGradStats(tensors, sizes, num_tensors, result, stream);
}

}  // namespace tally::kernels
