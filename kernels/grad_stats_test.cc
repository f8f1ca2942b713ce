#include "kernels/grad_stats.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace tally::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Reference statistics from whole-tensor LibTorch reductions in fp64, which
// share no code or chunking with the kernel.
struct Reference {
  double sum_squares = 0.0;
  double max_abs = 0.0;
};

Reference ComputeReference(const std::vector<torch::Tensor>& tensors) {
  Reference reference;
  for (const torch::Tensor& tensor : tensors) {
    if (!tensor.defined() || tensor.numel() == 0) continue;
    torch::Tensor wide = tensor.to(torch::kDouble);
    reference.sum_squares += wide.square().sum().item<double>();
    reference.max_abs =
        std::max(reference.max_abs, wide.abs().max().item<double>());
  }
  return reference;
}

void ExpectMatchesReference(const std::vector<torch::Tensor>& tensors) {
  const Reference reference = ComputeReference(tensors);
  const GradStats stats = MultiTensorGradStats(tensors);
  EXPECT_NEAR(stats.sum_squares, reference.sum_squares,
              1e-12 * reference.sum_squares);
  EXPECT_EQ(stats.max_abs, reference.max_abs);
  EXPECT_FALSE(stats.nonfinite);
}

// Restores the ATen intra-op thread count when a test ends.
class ThreadCountRestorer {
 public:
  ThreadCountRestorer() : saved_(at::get_num_threads()) {}
  ~ThreadCountRestorer() { at::set_num_threads(saved_); }

 private:
  int saved_;
};

class GradStatsDtypeTest : public ::testing::TestWithParam<torch::Dtype> {
 protected:
  void SetUp() override { torch::manual_seed(1234); }

  torch::Tensor Random(std::vector<int64_t> shape) {
    return torch::randn(shape, torch::TensorOptions().dtype(GetParam()));
  }
};

TEST_P(GradStatsDtypeTest, MatchesReferenceForEachShape) {
  // {} is a 0-dim scalar; 65536 elements fill exactly one chunk.
  const std::vector<std::vector<int64_t>> shapes = {
      {},      {0},     {1},      {7},       {3, 5, 7},   {65535},
      {65536}, {65537}, {200003}, {4, 0, 3}, {131072 + 9}};
  for (const std::vector<int64_t>& shape : shapes) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    ExpectMatchesReference({Random(shape)});
  }
}

TEST_P(GradStatsDtypeTest, EmptyListAndEmptyTensorsGiveZero) {
  for (const std::vector<torch::Tensor>& tensors :
       {std::vector<torch::Tensor>{},
        std::vector<torch::Tensor>{Random({0}), torch::Tensor()}}) {
    const GradStats stats = MultiTensorGradStats(tensors);
    EXPECT_EQ(stats.sum_squares, 0.0);
    EXPECT_EQ(stats.max_abs, 0.0);
    EXPECT_FALSE(stats.nonfinite);
  }
}

TEST_P(GradStatsDtypeTest, ReadsNonContiguousTensorInLogicalOrder) {
  // Narrowed first, so that the storage also holds elements outside the view.
  torch::Tensor transposed = Random({301, 600}).narrow(1, 3, 517).t();
  ASSERT_FALSE(transposed.is_contiguous());
  ExpectMatchesReference({transposed});
  ExpectMatchesReference({Random({1000, 3}).select(1, 1)});
}

TEST_P(GradStatsDtypeTest, CombinesListOfMixedSizes) {
  ExpectMatchesReference({Random({65537}), Random({0}), Random({1}),
                          torch::Tensor(), Random({17, 33}),
                          Random({200003}) * 1e3, Random({2, 3, 5})});
}

TEST_P(GradStatsDtypeTest, NaNPropagatesToSumAndMax) {
  torch::Tensor poisoned = Random({200003});
  poisoned[150001] = kNaN;  // in the third chunk, not the first
  const GradStats stats =
      MultiTensorGradStats({Random({100}), poisoned, Random({5})});
  EXPECT_TRUE(std::isnan(stats.sum_squares));
  EXPECT_TRUE(std::isnan(stats.max_abs));
  EXPECT_TRUE(stats.nonfinite);
}

TEST_P(GradStatsDtypeTest, NaNWinsOverInfInAnotherTensor) {
  torch::Tensor with_inf = Random({33});
  with_inf[4] = kInf;
  torch::Tensor with_nan = Random({9});
  with_nan[8] = kNaN;  // the scalar tail of the lane loop
  const GradStats stats = MultiTensorGradStats({with_inf, with_nan});
  EXPECT_TRUE(std::isnan(stats.sum_squares));
  EXPECT_TRUE(std::isnan(stats.max_abs));
  EXPECT_TRUE(stats.nonfinite);
}

TEST_P(GradStatsDtypeTest, InfOfEitherSignIsReported) {
  for (double value : {kInf, -kInf}) {
    SCOPED_TRACE(value);
    torch::Tensor tensor = Random({65537});
    tensor[65536] = value;  // alone in the second chunk
    const GradStats stats = MultiTensorGradStats({tensor});
    EXPECT_EQ(stats.sum_squares, kInf);
    EXPECT_EQ(stats.max_abs, kInf);
    EXPECT_TRUE(stats.nonfinite);
  }
}

TEST_P(GradStatsDtypeTest, BitwiseIdenticalForOneAndTwoThreads) {
  ThreadCountRestorer restorer;
  // Many chunks of values spanning several orders of magnitude, so that a
  // different summation order would change the last bits.
  const std::vector<torch::Tensor> tensors = {
      Random({1 << 20}) * torch::exp(Random({1 << 20}) * 4), Random({77777}),
      Random({3, 100003})};
  at::set_num_threads(1);
  const GradStats one_thread = MultiTensorGradStats(tensors);
  at::set_num_threads(2);
  ASSERT_EQ(at::get_num_threads(), 2);
  const GradStats two_threads = MultiTensorGradStats(tensors);
  const GradStats again = MultiTensorGradStats(tensors);
  EXPECT_EQ(one_thread.sum_squares, two_threads.sum_squares);
  EXPECT_EQ(one_thread.max_abs, two_threads.max_abs);
  EXPECT_EQ(two_threads.sum_squares, again.sum_squares);
  ExpectMatchesReference(tensors);
}

INSTANTIATE_TEST_SUITE_P(
    FloatAndDouble, GradStatsDtypeTest,
    ::testing::Values(torch::kFloat, torch::kDouble),
    [](const ::testing::TestParamInfo<torch::Dtype>& info) {
      return std::string(c10::toString(info.param));
    });

TEST(GradStatsTest, HugeFloatGradientsStayFiniteInDouble) {
  const int64_t numel = 100001;
  torch::Tensor huge = torch::full({numel}, 1e20, torch::kFloat);
  huge[7] = -1e20;
  const double element = static_cast<double>(1e20f);
  // In fp32 each square (~1e40) would already overflow to Inf.
  ASSERT_TRUE(std::isinf(huge.square().sum().item<float>()));
  const GradStats stats = MultiTensorGradStats({huge});
  EXPECT_NEAR(stats.sum_squares, numel * element * element,
              1e-12 * numel * element * element);
  EXPECT_EQ(stats.max_abs, element);
  EXPECT_FALSE(stats.nonfinite);
}

TEST(GradStatsTest, FiniteDoublesWhoseSquaresOverflowAreNotNonfinite) {
  torch::Tensor huge = torch::full({10}, 1e200, torch::kDouble);
  const GradStats stats = MultiTensorGradStats({huge});
  EXPECT_EQ(stats.sum_squares, kInf);
  EXPECT_EQ(stats.max_abs, 1e200);
  EXPECT_FALSE(stats.nonfinite);
}

// Neighbouring chunks are swept in pairs of one dtype: a list alternating
// float and double chunks of uneven lengths, where no pair can form across
// the dtype change and the paired chunks differ in length.
TEST(GradStatsTest, MixedDtypeListMatchesReference) {
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  ExpectMatchesReference({torch::randn({65536 + 3}, f32),
                          torch::randn({2 * 65536 + 5}, f64),
                          torch::randn({7}, f32), torch::randn({65536}, f32),
                          torch::randn({11}, f64)});
}

TEST(GradStatsTest, RejectsUnsupportedDtypes) {
  const torch::Tensor floats = torch::ones({4});
  EXPECT_THROW(MultiTensorGradStats({floats, torch::ones({4}, torch::kInt)}),
               c10::Error);
  EXPECT_THROW(MultiTensorGradStats({torch::ones({4}, torch::kHalf)}),
               c10::Error);
  try {
    MultiTensorGradStats({floats, torch::ones({4}, torch::kInt)});
    ADD_FAILURE() << "an Int tensor was accepted";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find("tensors[1]"), std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace tally::kernels
