#include "kernels/grad_stats.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu_clones.h"
#include "kernels/cuda_tensors.h"

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

// The lanes of one chunk: lane i % kLanes takes element i, in order.
template <typename T>
struct Lanes {
  using Bits = typename MagnitudeBits<T>::Type;
  double sums[kLanes] = {};
  Bits maxes[kLanes] = {};
};

template <typename T>
[[gnu::always_inline]] inline void Accumulate(Lanes<T>& lanes, int lane, T x) {
  const double wide = static_cast<double>(x);
  lanes.sums[lane] += wide * wide;
  typename Lanes<T>::Bits magnitude;
  std::memcpy(&magnitude, &x, sizeof(magnitude));
  magnitude &= MagnitudeBits<T>::kAbsMask;
  lanes.maxes[lane] =
      magnitude > lanes.maxes[lane] ? magnitude : lanes.maxes[lane];
}

// Elements [begin, count) of a chunk, `begin` a multiple of kLanes.
template <typename T>
[[gnu::always_inline]] inline void AccumulateFrom(Lanes<T>& lanes,
                                                  const T* data, int64_t begin,
                                                  int64_t count) {
  const int64_t full = count - count % kLanes;
  for (int64_t i = begin; i < full; i += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) {
      Accumulate(lanes, lane, data[i + lane]);
    }
  }
  for (int64_t i = full; i < count; ++i) {
    Accumulate(lanes, static_cast<int>(i - full), data[i]);
  }
}

template <typename T>
ChunkStats Reduce(const Lanes<T>& lanes) {
  ChunkStats stats;
  typename Lanes<T>::Bits max_bits = 0;
  for (int lane = 0; lane < kLanes; ++lane) {
    stats.sum_squares += lanes.sums[lane];
    max_bits = std::max(max_bits, lanes.maxes[lane]);
  }
  T max_abs;
  std::memcpy(&max_abs, &max_bits, sizeof(max_abs));
  stats.max_abs = static_cast<double>(max_abs);
  return stats;
}

// Two chunks in one loop: two memory streams keep more cache-line fills in
// flight than one, which a read-only sweep needs to approach the memory
// bandwidth on one core (bench_optim_step's stats_s). Each chunk keeps its
// own lanes in the same order, so the result is bitwise that of sweeping the
// chunks one by one. Inlined only into the clones below: inlined into the
// parallel_for body, GCC 12 no longer vectorizes the lane loops.
template <typename T>
[[gnu::always_inline]] inline void SweepPair(const T* a, int64_t a_count,
                                             const T* b, int64_t b_count,
                                             ChunkStats* out) {
  Lanes<T> first, second;
  const int64_t both = std::min(a_count, b_count);
  const int64_t common = both - both % kLanes;
  for (int64_t i = 0; i < common; i += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) {
      Accumulate(first, lane, a[i + lane]);
    }
    for (int lane = 0; lane < kLanes; ++lane) {
      Accumulate(second, lane, b[i + lane]);
    }
  }
  AccumulateFrom(first, a, common, a_count);
  AccumulateFrom(second, b, common, b_count);
  out[0] = Reduce(first);
  out[1] = Reduce(second);
}

// b_count = 0 sweeps chunk a alone.
TALLY_KERNEL_CLONES void SweepChunks(const float* a, int64_t a_count,
                                     const float* b, int64_t b_count,
                                     ChunkStats* out) {
  SweepPair(a, a_count, b, b_count, out);
}
TALLY_KERNEL_CLONES void SweepChunks(const double* a, int64_t a_count,
                                     const double* b, int64_t b_count,
                                     ChunkStats* out) {
  SweepPair(a, a_count, b, b_count, out);
}

// Sweeps chunk c, and chunk c + 1 with it when `paired`.
template <typename T>
void SweepFrom(const std::vector<Chunk>& chunks,
               const std::vector<torch::Tensor>& contiguous, int64_t c,
               bool paired, ChunkStats* partials) {
  const Chunk& a = chunks[c];
  const Chunk& b = chunks[paired ? c + 1 : c];
  ChunkStats out[2];
  SweepChunks(contiguous[a.tensor_index].data_ptr<T>() + a.begin,
              a.end - a.begin,
              contiguous[b.tensor_index].data_ptr<T>() + b.begin,
              paired ? b.end - b.begin : 0, out);
  partials[c] = out[0];
  if (paired) partials[c + 1] = out[1];
}

}  // namespace

GradStats MultiTensorGradStats(const std::vector<torch::Tensor>& tensors) {
  const torch::Tensor* first = nullptr;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) continue;
    if (first == nullptr) first = &tensors[i];
    TORCH_CHECK(tensors[i].device() == first->device(),
                "MultiTensorGradStats: tensors[", i, "] is on ",
                tensors[i].device(), " but the first defined tensor on ",
                first->device(), ": one call reads the tensors of one device");
    TORCH_CHECK(tensors[i].device().is_cpu() || tensors[i].device().is_cuda(),
                "MultiTensorGradStats: tensors[", i, "] is on ",
                tensors[i].device(), "; expected cpu or cuda");
    TORCH_CHECK(tensors[i].scalar_type() == torch::kFloat ||
                    tensors[i].scalar_type() == torch::kDouble,
                "MultiTensorGradStats: tensors[", i, "] has dtype ",
                tensors[i].scalar_type(), "; expected Float or Double");
  }
  if (first != nullptr && first->is_cuda()) {
    absl::StatusOr<GradStats> stats = GradStatsCudaTensors(tensors);
    TORCH_CHECK(stats.ok(),
                "MultiTensorGradStats: ", stats.status().ToString());
    return *stats;
  }
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
        // Neighbouring chunks of one dtype go in pairs.
        for (int64_t c = first; c < last;) {
          const torch::ScalarType dtype =
              contiguous[chunks[c].tensor_index].scalar_type();
          const bool paired =
              c + 1 < last &&
              contiguous[chunks[c + 1].tensor_index].scalar_type() == dtype;
          if (dtype == torch::kFloat) {
            SweepFrom<float>(chunks, contiguous, c, paired, partials.data());
          } else {
            SweepFrom<double>(chunks, contiguous, c, paired, partials.data());
          }
          c += paired ? 2 : 1;
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
