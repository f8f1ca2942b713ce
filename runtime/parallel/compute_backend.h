// What this process computes with: the BLAS library LibTorch's fp32/fp64
// matmuls resolved (`sgemm_` comes from whichever `libblas.so.3` the dynamic
// linker picked, which Debian's alternatives decide), whether oneDNN (bf16
// matmuls) is built in, and the intra-op thread count. LibTorch's CPU speed is
// its BLAS's: the reference BLAS runs ~5 GFLOP/s per core where BLIS runs
// 70-95, so a server logs what it found and warns on the reference one.
//
// Threads: LibTorch's OpenMP pool follows at::set_num_threads, BLIS and
// OpenBLAS do not (BLIS reads BLIS_NUM_THREADS once, OpenBLAS takes every
// core); SetComputeThreads sets all three.
//
//   TALLY_RETURN_IF_ERROR(tally::SetComputeThreads(
//       tally::DefaultComputeThreads(/*local_ranks=*/4)));
//   const tally::ComputeBackend backend = tally::DetectComputeBackend();
//   Log(kInfo, backend.Describe());
#ifndef TALLY_RUNTIME_PARALLEL_COMPUTE_BACKEND_H_
#define TALLY_RUNTIME_PARALLEL_COMPUTE_BACKEND_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tally {

enum class BlasVendor { kUnknown, kReference, kBlis, kOpenBlas, kMkl };

// "unknown", "reference", "blis", "openblas", "mkl".
absl::string_view BlasVendorName(BlasVendor vendor);

struct ComputeBackend {
  BlasVendor blas = BlasVendor::kUnknown;
  // The file `sgemm_` was resolved from, symlinks (alternatives) followed;
  // empty when the symbol is not in the process.
  std::string blas_library;
  bool onednn = false;  // LibTorch built with oneDNN (bf16 matmuls)
  int threads = 0;      // at::get_num_threads()

  // One line for the log: "BLAS blis (/usr/lib/.../libblas.so.3), oneDNN
  // yes, 2 threads".
  std::string Describe() const;
  // The reference BLAS is ~15x slower than a tuned one for tally's shapes.
  bool slow_blas() const { return blas == BlasVendor::kReference; }
};

ComputeBackend DetectComputeBackend();

// OMP_NUM_THREADS when the environment sets it (as torchrun does), else
// max(1, cores / local_ranks): the ranks of one machine share its cores,
// where cores are those this process may run on (sched_getaffinity), capped
// by the cgroup v2 CPU quota (/sys/fs/cgroup/cpu.max, a Kubernetes CPU
// limit) rounded up. More threads than cores is slow: BLIS's threads wait
// for each other spinning.
int DefaultComputeThreads(int local_ranks);

// The CPU quota of a cgroup v2 cpu.max file ("<quota> <period>"), rounded
// up to whole cores; 0 for "max", a missing file or a malformed one.
int CgroupCpuLimit(const std::string& cpu_max);

// LibTorch's intra-op threads and, when the BLAS is BLIS or OpenBLAS, the
// BLAS's own. INVALID_ARGUMENT for threads < 1.
absl::Status SetComputeThreads(int threads);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_COMPUTE_BACKEND_H_
