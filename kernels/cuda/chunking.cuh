// The launch shape every multi-tensor CUDA kernel of tally shares: the
// tensors are cut into fixed-size chunks, one thread block per chunk. The
// size is fixed (not derived from the device) so that per-chunk partials, and
// with them the results, are the same on every GPU; for elementwise updates
// it only balances the blocks.
//
//   for (int64_t begin = 0; begin < n; begin += tally::kernels::kChunkElements)
//   kernel<<<num_chunks, tally::kernels::kBlockThreads>>>(...);
#ifndef TALLY_KERNELS_CUDA_CHUNKING_CUH_
#define TALLY_KERNELS_CUDA_CHUNKING_CUH_

#include <cstdint>

namespace tally::kernels {

inline constexpr int kBlockThreads = 256;
inline constexpr int64_t kChunkElements = 16 * 1024;

}  // namespace tally::kernels

#endif  // TALLY_KERNELS_CUDA_CHUNKING_CUH_
