// TALLY_KERNEL_CLONES: builds a CPU kernel function twice on x86-64, for the
// baseline ISA and for AVX2 + FMA (x86-64-v3), the copy picked at load time
// from the CPU's features. Contiguous loops then run 256-bit vectors and a
// hardware fma where the CPU has them, without requiring them to run.
// Put it on non-template, non-inline functions (GCC's target_clones).
//
//   TALLY_KERNEL_CLONES void ScaleChunk(float* data, int64_t n, float s) {
//     for (int64_t i = 0; i < n; ++i) data[i] *= s;
//   }
#ifndef TALLY_KERNELS_CPU_CLONES_H_
#define TALLY_KERNELS_CPU_CLONES_H_

#if defined(__x86_64__) && defined(__GNUC__)
#define TALLY_KERNEL_CLONES [[gnu::target_clones("arch=x86-64-v3", "default")]]
#else
#define TALLY_KERNEL_CLONES
#endif

#endif  // TALLY_KERNELS_CPU_CLONES_H_
