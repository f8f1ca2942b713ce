// The bfloat16 -> float32 matmul (kernels/onednn_matmul.h) and the
// tensor-parallel linears built on it (ColumnParallelLinear,
// RowParallelLinear in runtime/parallel/parallel_ops.h), against the float32
// composition (the bfloat16 operands widened, then float32 matmuls), with a
// finite-difference gradient check of the linears in float64.
//
// Tolerances. Every product of two bfloat16 values is exact in float32, so
// the kernel and the float32 composition differ only in the order of their
// float32 additions: for an inner size K each is within
// E = K u32 (|a| @ |b|) of the exact sum (u32 = 2^-24, the standard bound
// for summation in any order), hence within 2E of each other
// (SummationBound). A float32 sum s rounded once to bfloat16 (unit roundoff
// u16 = 2^-8) is within u16 |s| <= u16 (|ref| + 2E) of s, so within
// u16 |ref| + (1 + u16) 2E of the composition ref (RoundedBound).
#include "kernels/onednn_matmul.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <vector>

#include "runtime/parallel/parallel_ops.h"

namespace tally {
namespace {

constexpr double kFloat32Unit = 1.0 / (1 << 24);
constexpr double kBFloat16Unit = 1.0 / (1 << 8);

torch::Tensor RandomBf16(std::vector<int64_t> sizes, int64_t seed) {
  torch::manual_seed(seed);
  return torch::randn(sizes).to(torch::kBFloat16);
}

torch::Tensor Wide(const torch::Tensor& t) { return t.to(torch::kFloat64); }

// The float32 composition: the operands widened, one float32 matmul.
torch::Tensor Float32Product(const torch::Tensor& a, const torch::Tensor& b) {
  return a.to(torch::kFloat32).mm(b.to(torch::kFloat32));
}

// 2 K u32 (|a| @ |b|): how far two float32 summation orders may differ.
torch::Tensor SummationBound(const torch::Tensor& a, const torch::Tensor& b) {
  return 2 * a.size(1) * kFloat32Unit * Wide(a).abs().mm(Wide(b).abs());
}

// u16 |ref| + (1 + u16) 2E: a float32 sum rounded once to bfloat16.
torch::Tensor RoundedBound(const torch::Tensor& ref, const torch::Tensor& a,
                           const torch::Tensor& b) {
  return kBFloat16Unit * Wide(ref).abs() +
         (1 + kBFloat16Unit) * SummationBound(a, b);
}

// Asserts |got - want| <= bound elementwise, reporting the worst element.
void ExpectWithin(const torch::Tensor& got, const torch::Tensor& want,
                  const torch::Tensor& bound) {
  ASSERT_EQ(got.sizes(), want.sizes());
  const torch::Tensor excess = (Wide(got) - Wide(want)).abs() - bound;
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << "max |got - want| " << (Wide(got) - Wide(want)).abs().max()
      << ", max excess over the bound " << excess.max();
}

// The matmul's own tests; a build without it (its LibTorch is not
// Debian's: kernels/onednn_matmul_stub.cc) skips them, saying so.
class MatmulBf16ToFloat32Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HasBf16ToFloat32Matmul()) {
      GTEST_SKIP() << "this build has no oneDNN matmul (its LibTorch is not "
                      "Debian's LibTorch 1.x): kernels/onednn_matmul_stub.cc";
    }
  }
};

TEST(OnednnMatmulStubTest, UnimplementedWithoutTheMatmul) {
  if (HasBf16ToFloat32Matmul()) {
    GTEST_SKIP() << "this build has the oneDNN matmul (Debian's LibTorch)";
  }
  EXPECT_EQ(MatmulBf16ToFloat32(RandomBf16({4, 8}, 1), RandomBf16({8, 5}, 2))
                .status()
                .code(),
            absl::StatusCode::kUnimplemented);
}

TEST_F(MatmulBf16ToFloat32Test, MatchesTheFloat32Composition) {
  const torch::Tensor a = RandomBf16({37, 300}, 1);
  const torch::Tensor b = RandomBf16({300, 53}, 2);
  absl::StatusOr<torch::Tensor> got = MatmulBf16ToFloat32(a, b);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->scalar_type(), torch::kFloat32);
  ExpectWithin(*got, Float32Product(a, b), SummationBound(a, b));
  // Not rounded to bfloat16: LibTorch's bfloat16 matmul is, and lies
  // further from the float32 sums than the summation bound allows.
  const torch::Tensor rounded = a.mm(b);
  EXPECT_GT(((Wide(rounded) - Wide(Float32Product(a, b))).abs() -
             SummationBound(a, b))
                .max()
                .item<double>(),
            0.0);
}

TEST_F(MatmulBf16ToFloat32Test, ReadsTransposedAndStridedOperands) {
  const torch::Tensor x = RandomBf16({19, 64}, 3);
  const torch::Tensor w = RandomBf16({24, 64}, 4);  // a linear's [out, in]
  const torch::Tensor wide = RandomBf16({64, 48}, 5);
  struct Case {
    const char* name;
    torch::Tensor a, b;
  };
  const std::vector<Case> cases = {
      {"x @ w^T (b column-major)", x, w.t()},
      {"x^T^T @ w^T (a column-major)", x.t().contiguous().t(), w.t()},
      {"every other column of a (copied)", wide.t().slice(1, 0, 64, 2),
       RandomBf16({32, 7}, 6)},
      {"a row of a", x.slice(0, 3, 4), w.t()},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<torch::Tensor> got = MatmulBf16ToFloat32(c.a, c.b);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectWithin(*got, Float32Product(c.a, c.b), SummationBound(c.a, c.b));
    // The cached primitive gives the same bits again.
    absl::StatusOr<torch::Tensor> again = MatmulBf16ToFloat32(c.a, c.b);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(torch::equal(*got, *again));
  }
}

TEST_F(MatmulBf16ToFloat32Test, EmptyOperands) {
  absl::StatusOr<torch::Tensor> no_rows =
      MatmulBf16ToFloat32(RandomBf16({0, 8}, 7), RandomBf16({8, 5}, 8));
  ASSERT_TRUE(no_rows.ok()) << no_rows.status();
  EXPECT_EQ(no_rows->sizes(), torch::IntArrayRef({0, 5}));
  absl::StatusOr<torch::Tensor> empty_sum =
      MatmulBf16ToFloat32(RandomBf16({3, 0}, 9), RandomBf16({0, 5}, 10));
  ASSERT_TRUE(empty_sum.ok()) << empty_sum.status();
  EXPECT_TRUE(torch::equal(*empty_sum, torch::zeros({3, 5})));
}

TEST_F(MatmulBf16ToFloat32Test, RefusesWhatItCannotRead) {
  const torch::Tensor a = RandomBf16({4, 8}, 11);
  const torch::Tensor b = RandomBf16({8, 5}, 12);
  struct Case {
    torch::Tensor a, b;
    const char* names;  // in the message
  };
  const std::vector<Case> cases = {
      {a.to(torch::kFloat32), b, "a must be bfloat16"},
      {a, b.to(torch::kFloat64), "b must be bfloat16"},
      {a.unsqueeze(0), b, "a must be a 2-D tensor"},
      {a, torch::Tensor(), "b must be a 2-D tensor"},
      {a, b.t(), "inner sizes differ"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<torch::Tensor> got = MatmulBf16ToFloat32(c.a, c.b);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument)
        << c.names;
    EXPECT_NE(got.status().message().find(c.names), std::string::npos)
        << got.status();
  }
}

// Finite differences of sum(op(x, w) * probe) in float64 against the op's
// backward, every element of x and w.
void GradientCheck(const std::function<torch::Tensor(
                       const torch::Tensor&, const torch::Tensor&)>& op) {
  torch::manual_seed(13);
  const torch::TensorOptions f64 = torch::dtype(torch::kFloat64);
  torch::Tensor x = torch::randn({2, 3, 4}, f64).requires_grad_();
  torch::Tensor w = torch::randn({5, 4}, f64).requires_grad_();
  const torch::Tensor probe = torch::randn({2, 3, 5}, f64);
  (op(x, w) * probe).sum().backward();
  constexpr double kStep = 1e-6;
  torch::NoGradGuard no_grad;
  for (torch::Tensor* t : {&x, &w}) {
    const torch::Tensor flat = t->view({-1});
    const torch::Tensor grad = t->grad().view({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double saved = flat[i].item<double>();
      flat[i] = saved + kStep;
      const double up = (op(x, w) * probe).sum().item<double>();
      flat[i] = saved - kStep;
      const double down = (op(x, w) * probe).sum().item<double>();
      flat[i] = saved;
      // The loss is linear in each element: central differences are exact
      // up to float64 rounding of the loss (~1e-15 / 1e-6).
      EXPECT_NEAR(grad[i].item<double>(), (up - down) / (2 * kStep), 1e-8)
          << (t == &x ? "x" : "w") << " element " << i;
    }
  }
}

TEST(TensorParallelLinearTest, GradientCheckInFloat64) {
  GradientCheck([](const torch::Tensor& x, const torch::Tensor& w) {
    return ColumnParallelLinear(x, w, torch::kFloat64);
  });
  GradientCheck([](const torch::Tensor& x, const torch::Tensor& w) {
    return RowParallelLinear(x, w);
  });
  const torch::Tensor bias = torch::randn({5}, torch::kFloat64);
  GradientCheck([&](const torch::Tensor& x, const torch::Tensor& w) {
    return ColumnParallelLinear(x, w, torch::kFloat64, bias);
  });
}

// A column-parallel bias joins the float32 sum, which is rounded once, as
// one rank's fused linear rounds it; its gradient is the float32 sum of the
// rows' gradients, rounded once. x @ w^T is 1 + 3 * 2^-10 (bfloat16 would
// round it to 1) and the bias 3 * 2^-10: rounding the product before
// adding the bias gives 1, one rounding of the sum 1 + 2^-7. The bias's
// gradient adds the same values over three rows.
TEST(TensorParallelLinearTest, ColumnBiasIsAddedBeforeTheOneRounding) {
  const double small = std::ldexp(3.0, -10);
  const torch::Tensor x = torch::ones({3, 2});  // float32 region input
  torch::Tensor w =
      torch::tensor({1.0, small}).repeat({4, 1}).to(torch::kBFloat16);
  torch::Tensor bias =
      torch::full({4}, small).to(torch::kBFloat16).requires_grad_();
  w.requires_grad_();
  torch::Tensor y = ColumnParallelLinear(x, w, torch::kBFloat16, bias);
  const torch::Tensor once =
      torch::full({4}, 1.0 + std::ldexp(1.0, -7)).to(torch::kBFloat16);
  ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(y, once.expand({3, 4}))) << y;
  y.backward(torch::tensor({1.0, small, small})
                 .unsqueeze(1)
                 .expand({3, 4})
                 .to(torch::kBFloat16));
  ASSERT_EQ(bias.grad().scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(bias.grad(), once)) << bias.grad();
}

// Two "ranks" of a bfloat16 row-parallel linear: each rank's partial output
// stays float32, so their sum rounded once is within one rounding of the
// float32 composition, as one rank's bfloat16 linear is.
TEST(TensorParallelLinearTest, RowParallelPartialsRoundOnce) {
  const torch::Tensor x = RandomBf16({6, 10, 256}, 14);
  const torch::Tensor w = RandomBf16({96, 256}, 15);
  torch::Tensor sum = torch::zeros({6, 10, 96});
  for (int rank = 0; rank < 2; ++rank) {
    const torch::Tensor partial = RowParallelLinear(
        x.narrow(-1, rank * 128, 128), w.narrow(1, rank * 128, 128));
    ASSERT_EQ(partial.scalar_type(), torch::kFloat32);
    sum += partial;
  }
  const torch::Tensor rows = x.reshape({-1, 256});
  const torch::Tensor ref = Float32Product(rows, w.t());
  ExpectWithin(sum.to(torch::kBFloat16).reshape({-1, 96}), ref,
               RoundedBound(ref, rows, w.t()));
}

// Backward of two ranks: the column-parallel input gradients are float32
// partials whose sum is the float32 composition's (summation order only);
// the row-parallel ones and both weight gradients are complete, rounded
// once as one rank's.
TEST(TensorParallelLinearTest, BackwardPartialsStayFloat32) {
  const torch::Tensor h = RandomBf16({40, 128}, 16);
  const torch::Tensor w = RandomBf16({64, 128}, 17);  // column: [out, in]
  const torch::Tensor g = RandomBf16({40, 64}, 18);
  torch::Tensor x = h.to(torch::kFloat32).requires_grad_();
  torch::Tensor grad_w_rows;
  for (int rank = 0; rank < 2; ++rank) {
    const torch::Tensor w_rank =
        w.narrow(0, rank * 32, 32).clone().requires_grad_();
    ColumnParallelLinear(x, w_rank, torch::kBFloat16)
        .backward(g.narrow(1, rank * 32, 32));
    grad_w_rows =
        rank == 0 ? w_rank.grad() : torch::cat({grad_w_rows, w_rank.grad()}, 0);
  }
  ASSERT_EQ(x.grad().scalar_type(), torch::kFloat32);
  ExpectWithin(x.grad(), Float32Product(g, w), SummationBound(g, w));
  const torch::Tensor ref_w = Float32Product(g.t(), h);
  ExpectWithin(grad_w_rows, ref_w, RoundedBound(ref_w, g.t(), h));

  // Row-parallel: the incoming gradient (of the tp sum) is complete and
  // holds bfloat16 values; both gradients are rounded once.
  const torch::Tensor w_row = RandomBf16({48, 64}, 19);  // [out, in_local]
  const torch::Tensor g_row = RandomBf16({40, 48}, 20);
  const torch::Tensor a_local = h.narrow(1, 0, 64);
  torch::Tensor a = a_local.clone().requires_grad_();
  torch::Tensor w_leaf = w_row.clone().requires_grad_();
  RowParallelLinear(a, w_leaf).backward(g_row.to(torch::kFloat32));
  ASSERT_EQ(a.grad().scalar_type(), torch::kBFloat16);
  const torch::Tensor ref_a = Float32Product(g_row, w_row);
  ExpectWithin(a.grad(), ref_a, RoundedBound(ref_a, g_row, w_row));
  const torch::Tensor ref_w_row = Float32Product(g_row.t(), a_local);
  ExpectWithin(w_leaf.grad(), ref_w_row,
               RoundedBound(ref_w_row, g_row.t(), a_local));
}

}  // namespace
}  // namespace tally
