#include "kernels/grad_stats.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu_clones.h"

namespace tally::kernels {
namespace {

// Fixed so that chunk boundaries, and with them every partial sum, do not
// depend on the thread count: this is what makes the result deterministic.
constexpr int64_t kChunkElements = 64 * 1024;

// Independent accumulators per chunk: they break the loop-carried dependency
// of one running sum and let GCC vectorize without reassociating fp adds.
constexpr int kLanes = 8;

struct ChunkStats {
  double sum_squares = 0.0;
  double max_abs = 0.0;  // NaN if the chunk holds a NaN
};

struct Chunk {
  int tensor_index;
  int64_t begin;
  int64_t end;
};

// With the sign bit cleared, IEEE bit patterns order like the magnitudes they
// encode and every NaN lands above +Inf. So an unsigned max over them is a
// NaN-propagating max |x|, and unlike a NaN-aware fp max GCC vectorizes it.
template <typename T>
struct MagnitudeBits;
template <>
struct MagnitudeBits<float> {
  using Type = uint32_t;
  static constexpr Type kAbsMask = 0x7fffffffu;
};
template <>
struct MagnitudeBits<double> {
  using Type = uint64_t;
  static constexpr Type kAbsMask = 0x7fffffffffffffffull;
};

// Inlined only into the SweepChunk clones below: inlined into the
// parallel_for body, GCC 12 no longer vectorizes the lane loop.
template <typename T>
[[gnu::always_inline]] inline ChunkStats SweepLanes(const T* data,
                                                    int64_t count) {
  using Bits = typename MagnitudeBits<T>::Type;
  double sums[kLanes] = {};
  Bits maxes[kLanes] = {};
  const auto accumulate = [&](int lane, T x) {
    const double wide = static_cast<double>(x);
    sums[lane] += wide * wide;
    Bits magnitude;
    std::memcpy(&magnitude, &x, sizeof(magnitude));
    magnitude &= MagnitudeBits<T>::kAbsMask;
    maxes[lane] = magnitude > maxes[lane] ? magnitude : maxes[lane];
  };
  const int64_t full = count - count % kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) accumulate(lane, data[i + lane]);
  }
  for (int64_t i = full; i < count; ++i) {
    accumulate(static_cast<int>(i - full), data[i]);
  }

  ChunkStats stats;
  Bits max_bits = 0;
  for (int lane = 0; lane < kLanes; ++lane) {
    stats.sum_squares += sums[lane];
    max_bits = std::max(max_bits, maxes[lane]);
  }
  T max_abs;
  std::memcpy(&max_abs, &max_bits, sizeof(max_abs));
  stats.max_abs = static_cast<double>(max_abs);
  return stats;
}

// The lanes stay independent, so every clone computes the same bits.
TALLY_KERNEL_CLONES ChunkStats SweepChunk(const float* data, int64_t count) {
  return SweepLanes(data, count);
}
TALLY_KERNEL_CLONES ChunkStats SweepChunk(const double* data, int64_t count) {
  return SweepLanes(data, count);
}

}  // namespace

GradStats MultiTensorGradStats(const std::vector<torch::Tensor>& tensors) {
  // Contiguous tensors are shared, not copied; the copies of the others must
  // outlive the sweep.
  std::vector<torch::Tensor> contiguous;
  contiguous.reserve(tensors.size());
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::Tensor& tensor = tensors[i];
    if (!tensor.defined()) {
      contiguous.emplace_back();
      continue;
    }
    TORCH_CHECK(tensor.device().is_cpu(), "MultiTensorGradStats: tensors[", i,
                "] is on ", tensor.device(), "; expected cpu");
    TORCH_CHECK(tensor.scalar_type() == torch::kFloat ||
                    tensor.scalar_type() == torch::kDouble,
                "MultiTensorGradStats: tensors[", i, "] has dtype ",
                tensor.scalar_type(), "; expected Float or Double");
    contiguous.push_back(tensor.contiguous());
    const int64_t numel = tensor.numel();
    for (int64_t begin = 0; begin < numel; begin += kChunkElements) {
      chunks.push_back({static_cast<int>(i), begin,
                        std::min(begin + kChunkElements, numel)});
    }
  }

  std::vector<ChunkStats> partials(chunks.size());
  at::parallel_for(
      0, static_cast<int64_t>(chunks.size()), /*grain_size=*/1,
      [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          const Chunk& chunk = chunks[c];
          const torch::Tensor& tensor = contiguous[chunk.tensor_index];
          const int64_t count = chunk.end - chunk.begin;
          if (tensor.scalar_type() == torch::kFloat) {
            partials[c] =
                SweepChunk(tensor.data_ptr<float>() + chunk.begin, count);
          } else {
            partials[c] =
                SweepChunk(tensor.data_ptr<double>() + chunk.begin, count);
          }
        }
      });

  GradStats stats;
  for (const ChunkStats& partial : partials) {
    stats.sum_squares += partial.sum_squares;
    // Once NaN, max_abs stays NaN: nothing compares greater than it.
    if (std::isnan(partial.max_abs) || partial.max_abs > stats.max_abs) {
      stats.max_abs = partial.max_abs;
    }
  }
  // max_abs is NaN or Inf exactly when some element is; sum_squares can also
  // overflow to Inf from finite fp64 elements, which is not "nonfinite".
  stats.nonfinite = !std::isfinite(stats.max_abs);
  return stats;
}

}  // namespace tally::kernels
