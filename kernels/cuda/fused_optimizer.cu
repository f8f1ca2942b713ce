#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "kernels/cuda/chunking.cuh"
#include "kernels/cuda/fused_optimizer_cuda.h"
#include "kernels/optimizer_math.h"

namespace tally::kernels {
namespace {

// One chunk's operands; the moments are null for SGD.
template <typename T>
struct Chunk {
  T* param;
  const T* grad;
  T* exp_avg;
  T* exp_avg_sq;
  int64_t count;
};

template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    AdamWKernel(const Chunk<T>* __restrict__ chunks, AdamWConstants<T> c) {
  const Chunk<T> chunk = chunks[blockIdx.x];
  for (int64_t i = threadIdx.x; i < chunk.count; i += kBlockThreads) {
    T param = chunk.param[i];
    T exp_avg = chunk.exp_avg[i];
    T exp_avg_sq = chunk.exp_avg_sq[i];
    AdamWElement(param, chunk.grad[i], exp_avg, exp_avg_sq, c);
    chunk.param[i] = param;
    chunk.exp_avg[i] = exp_avg;
    chunk.exp_avg_sq[i] = exp_avg_sq;
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    SgdKernel(const Chunk<T>* __restrict__ chunks, SgdConstants<T> c) {
  const Chunk<T> chunk = chunks[blockIdx.x];
  for (int64_t i = threadIdx.x; i < chunk.count; i += kBlockThreads) {
    T param = chunk.param[i];
    SgdElement(param, chunk.grad[i], c);
    chunk.param[i] = param;
  }
}

// The chunk table of `num_tensors` entries, or cudaErrorInvalidValue for bad
// arguments. Without `adamw` (SGD) the moment arrays are ignored.
template <typename T>
cudaError_t BuildChunks(T* const* params, const T* const* grads,
                        T* const* exp_avgs, T* const* exp_avg_sqs,
                        const int64_t* sizes, int num_tensors, bool adamw,
                        std::vector<Chunk<T>>& chunks) {
  if (num_tensors < 0 ||
      (num_tensors > 0 &&
       (params == nullptr || grads == nullptr || sizes == nullptr ||
        (adamw && (exp_avgs == nullptr || exp_avg_sqs == nullptr))))) {
    return cudaErrorInvalidValue;
  }
  for (int i = 0; i < num_tensors; ++i) {
    if (sizes[i] < 0) return cudaErrorInvalidValue;
    if (sizes[i] > 0 &&
        (params[i] == nullptr || grads[i] == nullptr ||
         (adamw && (exp_avgs[i] == nullptr || exp_avg_sqs[i] == nullptr)))) {
      return cudaErrorInvalidValue;
    }
    for (int64_t begin = 0; begin < sizes[i]; begin += kChunkElements) {
      chunks.push_back({params[i] + begin, grads[i] + begin,
                        adamw ? exp_avgs[i] + begin : nullptr,
                        adamw ? exp_avg_sqs[i] + begin : nullptr,
                        std::min(kChunkElements, sizes[i] - begin)});
    }
  }
  // The grid size is an int.
  if (chunks.size() > static_cast<size_t>(INT_MAX)) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// Copies the table to the device and runs `launch(table, num_chunks)`.
template <typename T, typename Launch>
cudaError_t LaunchOverChunks(const std::vector<Chunk<T>>& chunks,
                             cudaStream_t stream, Launch launch) {
  if (chunks.empty()) return cudaSuccess;
  const size_t table_bytes = chunks.size() * sizeof(Chunk<T>);
  Chunk<T>* table = nullptr;
  cudaError_t error =
      cudaMallocAsync(reinterpret_cast<void**>(&table), table_bytes, stream);
  if (error != cudaSuccess) return error;
  // From pageable memory the copy is staged before the call returns, so
  // `chunks` may be destroyed while the copy is still in flight.
  error = cudaMemcpyAsync(table, chunks.data(), table_bytes,
                          cudaMemcpyHostToDevice, stream);
  if (error == cudaSuccess) {
    launch(table, static_cast<int>(chunks.size()));
    error = cudaGetLastError();
  }
  const cudaError_t free_error = cudaFreeAsync(table, stream);
  return error != cudaSuccess ? error : free_error;
}

template <typename T>
cudaError_t LaunchAdamW(T* const* params, const T* const* grads,
                        T* const* exp_avgs, T* const* exp_avg_sqs,
                        const int64_t* sizes, int num_tensors,
                        const UpdateHyperparameters& hp, cudaStream_t stream) {
  std::vector<Chunk<T>> chunks;
  const cudaError_t error =
      BuildChunks(params, grads, exp_avgs, exp_avg_sqs, sizes, num_tensors,
                  /*adamw=*/true, chunks);
  if (error != cudaSuccess) return error;
  const AdamWConstants<T> constants = MakeAdamWConstants<T>(hp);
  return LaunchOverChunks(
      chunks, stream, [&](const Chunk<T>* table, int num_chunks) {
        AdamWKernel<T>
            <<<num_chunks, kBlockThreads, 0, stream>>>(table, constants);
      });
}

template <typename T>
cudaError_t LaunchSgd(T* const* params, const T* const* grads,
                      const int64_t* sizes, int num_tensors,
                      const UpdateHyperparameters& hp, cudaStream_t stream) {
  std::vector<Chunk<T>> chunks;
  const cudaError_t error =
      BuildChunks<T>(params, grads, nullptr, nullptr, sizes, num_tensors,
                     /*adamw=*/false, chunks);
  if (error != cudaSuccess) return error;
  const SgdConstants<T> constants = MakeSgdConstants<T>(hp);
  return LaunchOverChunks(
      chunks, stream, [&](const Chunk<T>* table, int num_chunks) {
        SgdKernel<T>
            <<<num_chunks, kBlockThreads, 0, stream>>>(table, constants);
      });
}

}  // namespace

cudaError_t FusedAdamWCuda(float* const* params, const float* const* grads,
                           float* const* exp_avgs, float* const* exp_avg_sqs,
                           const int64_t* sizes, int num_tensors,
                           const UpdateHyperparameters& hp,
                           cudaStream_t stream) {
  return LaunchAdamW(params, grads, exp_avgs, exp_avg_sqs, sizes, num_tensors,
                     hp, stream);
}

cudaError_t FusedAdamWCuda(double* const* params, const double* const* grads,
                           double* const* exp_avgs, double* const* exp_avg_sqs,
                           const int64_t* sizes, int num_tensors,
                           const UpdateHyperparameters& hp,
                           cudaStream_t stream) {
  return LaunchAdamW(params, grads, exp_avgs, exp_avg_sqs, sizes, num_tensors,
                     hp, stream);
}

cudaError_t FusedSgdCuda(float* const* params, const float* const* grads,
                         const int64_t* sizes, int num_tensors,
                         const UpdateHyperparameters& hp, cudaStream_t stream) {
  return LaunchSgd(params, grads, sizes, num_tensors, hp, stream);
}

cudaError_t FusedSgdCuda(double* const* params, const double* const* grads,
                         const int64_t* sizes, int num_tensors,
                         const UpdateHyperparameters& hp, cudaStream_t stream) {
  return LaunchSgd(params, grads, sizes, num_tensors, hp, stream);
}

}  // namespace tally::kernels
