#include "runtime/parallel/compute_backend.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

namespace tally {
namespace {

// Restores LibTorch's thread count and BLIS_NUM_THREADS after a test.
class ComputeBackendTest : public ::testing::Test {
 protected:
  void TearDown() override {
    at::set_num_threads(saved_threads_);
    if (saved_blis_.has_value()) {
      setenv("BLIS_NUM_THREADS", saved_blis_->c_str(), 1);
    } else {
      unsetenv("BLIS_NUM_THREADS");
    }
  }

 private:
  const int saved_threads_ = at::get_num_threads();
  const std::optional<std::string> saved_blis_ =
      std::getenv("BLIS_NUM_THREADS") == nullptr
          ? std::nullopt
          : std::optional<std::string>(std::getenv("BLIS_NUM_THREADS"));
};

TEST_F(ComputeBackendTest, FindsTheLibraryLibtorchsMatmulsCall) {
  const ComputeBackend backend = DetectComputeBackend();
  ASSERT_FALSE(backend.blas_library.empty()) << backend.Describe();
  EXPECT_TRUE(std::filesystem::is_regular_file(backend.blas_library))
      << backend.blas_library;
  // Debian's libblas.so.3 is the alternatives link LibTorch was linked
  // against; the detection must land on the file it points to.
  const std::filesystem::path link = "/usr/lib/x86_64-linux-gnu/libblas.so.3";
  if (std::filesystem::exists(link)) {
    EXPECT_EQ(backend.blas_library, std::filesystem::canonical(link).string());
  }
  EXPECT_EQ(backend.threads, at::get_num_threads());
  EXPECT_NE(backend.Describe().find(backend.blas_library), std::string::npos);
}

// scripts/install-deps.sh installs BLIS, which the alternatives system then
// picks: a machine set up by it must not be left on the reference BLAS.
TEST_F(ComputeBackendTest, TheInstalledBlasIsATunedOne) {
  const ComputeBackend backend = DetectComputeBackend();
  EXPECT_NE(backend.blas, BlasVendor::kReference) << backend.Describe();
  EXPECT_NE(backend.blas, BlasVendor::kUnknown) << backend.Describe();
  EXPECT_FALSE(backend.slow_blas());
  EXPECT_TRUE(backend.onednn) << "LibTorch without oneDNN has no fast bf16";
}

TEST_F(ComputeBackendTest, TheBlasComputesMatmulsRight) {
  // Some BLAS builds compute wrong results on some CPUs: compare both the
  // float64 and float32 GEMMs with a sum of products done elementwise.
  torch::manual_seed(3);
  for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const torch::Tensor a = torch::randn({67, 129}, dtype);
    const torch::Tensor b = torch::randn({129, 45}, dtype);
    const torch::Tensor by_products = (a.to(torch::kFloat64).unsqueeze(2) *
                                       b.to(torch::kFloat64).unsqueeze(0))
                                          .sum(1);
    const double tolerance = dtype == torch::kFloat64 ? 1e-12 : 1e-4;
    EXPECT_TRUE(torch::allclose(torch::mm(a, b).to(torch::kFloat64),
                                by_products, tolerance, tolerance))
        << c10::toString(dtype);
  }
}

TEST_F(ComputeBackendTest, SetsLibtorchAndBlasThreads) {
  ASSERT_TRUE(SetComputeThreads(1).ok());
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_STREQ(std::getenv("BLIS_NUM_THREADS"), "1");
  EXPECT_EQ(DetectComputeBackend().threads, 1);
  ASSERT_TRUE(SetComputeThreads(2).ok());
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_STREQ(std::getenv("BLIS_NUM_THREADS"), "2");

  const absl::Status zero = SetComputeThreads(0);
  EXPECT_EQ(zero.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zero.message().find("threads"), std::string::npos);
  EXPECT_EQ(at::get_num_threads(), 2) << "a refused count changes nothing";
}

TEST_F(ComputeBackendTest, ReadsTheCgroupCpuQuota) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("cpu.max." + std::to_string(getpid())))
                               .string();
  auto quota_of = [&](const std::string& text) {
    std::ofstream(path) << text;
    return CgroupCpuLimit(path);
  };
  EXPECT_EQ(quota_of("200000 100000\n"), 2);
  EXPECT_EQ(quota_of("150000 100000\n"), 2) << "rounded up";
  EXPECT_EQ(quota_of("50000 100000\n"), 1);
  EXPECT_EQ(quota_of("max 100000\n"), 0);
  EXPECT_EQ(quota_of("garbage"), 0);
  EXPECT_EQ(quota_of("100000 0"), 0);
  std::filesystem::remove(path);
  EXPECT_EQ(CgroupCpuLimit(path), 0) << "missing file";
}

TEST_F(ComputeBackendTest, DefaultThreadsShareTheCoresBetweenLocalRanks) {
  const std::optional<std::string> omp =
      std::getenv("OMP_NUM_THREADS") == nullptr
          ? std::nullopt
          : std::optional<std::string>(std::getenv("OMP_NUM_THREADS"));
  setenv("OMP_NUM_THREADS", "3", 1);
  EXPECT_EQ(DefaultComputeThreads(4), 3) << "the environment's choice first";
  unsetenv("OMP_NUM_THREADS");
  cpu_set_t cpus;
  ASSERT_EQ(sched_getaffinity(0, sizeof(cpus), &cpus), 0);
  int cores = CPU_COUNT(&cpus);
  if (const int quota = CgroupCpuLimit("/sys/fs/cgroup/cpu.max"); quota > 0) {
    cores = std::min(cores, quota);
  }
  EXPECT_EQ(DefaultComputeThreads(1), cores);
  EXPECT_EQ(DefaultComputeThreads(cores), 1);
  EXPECT_EQ(DefaultComputeThreads(cores * 4), 1) << "never 0";
  EXPECT_EQ(DefaultComputeThreads(0), cores);
  if (omp.has_value()) setenv("OMP_NUM_THREADS", omp->c_str(), 1);
}

}  // namespace
}  // namespace tally
