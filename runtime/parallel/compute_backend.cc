#include "runtime/parallel/compute_backend.h"

#include <dlfcn.h>
#include <sched.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/file_text.h"

namespace tally {
namespace {

// The file that defines `symbol` in this process, symlinks followed; empty
// when no loaded library defines it.
std::string LibraryDefining(const char* symbol) {
  void* address = dlsym(RTLD_DEFAULT, symbol);
  Dl_info info;
  if (address == nullptr || dladdr(address, &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  std::error_code error;
  const std::filesystem::path resolved =
      std::filesystem::canonical(info.dli_fname, error);
  return error ? std::string(info.dli_fname) : resolved.string();
}

// Debian installs each BLAS under a folder of its own (blas/ for the
// reference one, blis-pthread/, openblas-pthread/, ...) and points
// libblas.so.3 at one of them; OpenBLAS and MKL also export their own
// functions, whatever their file is called.
BlasVendor VendorOf(const std::string& library) {
  if (library.empty()) return BlasVendor::kUnknown;
  if (dlsym(RTLD_DEFAULT, "openblas_get_config") != nullptr ||
      absl::StrContains(library, "openblas")) {
    return BlasVendor::kOpenBlas;
  }
  if (dlsym(RTLD_DEFAULT, "mkl_get_max_threads") != nullptr ||
      absl::StrContains(library, "mkl")) {
    return BlasVendor::kMkl;
  }
  if (absl::StrContains(library, "blis")) return BlasVendor::kBlis;
  if (absl::StrContains(library, "/blas/")) return BlasVendor::kReference;
  return BlasVendor::kUnknown;
}

}  // namespace

absl::string_view BlasVendorName(BlasVendor vendor) {
  switch (vendor) {
    case BlasVendor::kReference:
      return "reference";
    case BlasVendor::kBlis:
      return "blis";
    case BlasVendor::kOpenBlas:
      return "openblas";
    case BlasVendor::kMkl:
      return "mkl";
    case BlasVendor::kUnknown:
      break;
  }
  return "unknown";
}

std::string ComputeBackend::Describe() const {
  return absl::StrCat("BLAS ", BlasVendorName(blas), " (",
                      blas_library.empty() ? "sgemm_ not found" : blas_library,
                      "), oneDNN ", onednn ? "yes" : "no", ", ", threads,
                      threads == 1 ? " thread" : " threads");
}

ComputeBackend DetectComputeBackend() {
  ComputeBackend backend;
  backend.blas_library = LibraryDefining("sgemm_");
  backend.blas = VendorOf(backend.blas_library);
  backend.onednn = at::hasMKLDNN();
  backend.threads = at::get_num_threads();
  return backend;
}

int CgroupCpuLimit(const std::string& cpu_max) {
  const absl::StatusOr<std::string> text =
      ReadFileUpTo(cpu_max, kMaxSystemFileBytes);
  if (!text.ok()) return 0;
  // "<quota> <period>", the quota "max" when there is none.
  const std::vector<absl::string_view> words =
      absl::StrSplit(*text, absl::ByAnyChar(" \t\n"), absl::SkipEmpty());
  int64_t period = 0;
  int64_t microseconds = 0;
  if (words.size() < 2 || !absl::SimpleAtoi(words[1], &period) || period <= 0 ||
      !absl::SimpleAtoi(words[0], &microseconds) || microseconds <= 0) {
    return 0;
  }
  return static_cast<int>((microseconds + period - 1) / period);
}

int DefaultComputeThreads(int local_ranks) {
  int requested = 0;
  if (const char* omp = std::getenv("OMP_NUM_THREADS");
      omp != nullptr && absl::SimpleAtoi(omp, &requested) && requested >= 1) {
    return requested;
  }
  // The cores this process may run on (a container's cpuset), not the
  // machine's, and no more than a CPU quota (a Kubernetes CPU limit) allows.
  cpu_set_t cpus;
  int cores = sched_getaffinity(0, sizeof(cpus), &cpus) == 0
                  ? CPU_COUNT(&cpus)
                  : static_cast<int>(std::thread::hardware_concurrency());
  if (const int quota = CgroupCpuLimit("/sys/fs/cgroup/cpu.max"); quota > 0) {
    cores = std::min(cores, quota);
  }
  return std::max(1, cores / std::max(1, local_ranks));
}

absl::Status SetComputeThreads(int threads) {
  if (threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads must be at least 1, got ", threads));
  }
  at::set_num_threads(threads);
  // BLIS reads BLIS_NUM_THREADS when it initializes, at its first call (its
  // libblas.so.3 exports no thread-setting function); OpenBLAS exports one.
  const std::string count = absl::StrCat(threads);
  setenv("BLIS_NUM_THREADS", count.c_str(), /*overwrite=*/1);
  using SetThreads = void (*)(int);
  if (auto* openblas = reinterpret_cast<SetThreads>(
          dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    openblas(threads);
  }
  return absl::OkStatus();
}

}  // namespace tally
