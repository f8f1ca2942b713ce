#include "kernels/chunked_xent.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tally::kernels {
namespace {

constexpr int64_t kVocab = 50;
constexpr int64_t kHidden = 16;

struct Inputs {
  torch::Tensor hidden;    // [2, 7, H], requires grad
  torch::Tensor weight;    // [V, H], requires grad
  torch::Tensor targets;   // [2, 7]
  torch::Tensor upstream;  // [2, 7]: d loss / d logprob, some zero (masked)
};

Inputs MakeInputs(torch::ScalarType dtype) {
  torch::manual_seed(7);
  Inputs in;
  in.hidden =
      torch::randn({2, 7, kHidden}, torch::kDouble).to(dtype).requires_grad_();
  in.weight = (torch::randn({kVocab, kHidden}, torch::kDouble) * 0.5)
                  .to(dtype)
                  .requires_grad_();
  in.targets = torch::randint(kVocab, {2, 7}, torch::kInt64);
  in.upstream = torch::randn({2, 7}, torch::kDouble);
  in.upstream.index_put_({0, 3}, 0.0);
  return in;
}

struct Result {
  torch::Tensor logprobs, grad_hidden, grad_weight;
};

// Runs `head` on fresh leaves copied from `in` and backpropagates upstream.
template <typename Head>
Result RunHead(const Inputs& in, Head head) {
  const torch::Tensor hidden = in.hidden.detach().clone().requires_grad_();
  const torch::Tensor weight = in.weight.detach().clone().requires_grad_();
  Result r;
  r.logprobs = head(hidden, weight, in.targets);
  (r.logprobs * in.upstream.to(r.logprobs.scalar_type())).sum().backward();
  r.grad_hidden = hidden.grad();
  r.grad_weight = weight.grad();
  return r;
}

Result Composed(const Inputs& in) {
  return RunHead(in, ComposedTargetLogprobs);
}

Result Chunked(const Inputs& in, int64_t chunk_rows) {
  return RunHead(in,
                 [chunk_rows](const torch::Tensor& h, const torch::Tensor& w,
                              const torch::Tensor& t) {
                   return ChunkedTargetLogprobs(h, w, t, chunk_rows);
                 });
}

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble))
      .abs()
      .max()
      .item<double>();
}

double MaxAbs(const torch::Tensor& a) {
  return a.to(torch::kDouble).abs().max().item<double>();
}

// 14 tokens: one per chunk, chunks that do not divide them, one chunk
// (0: the default size) and a chunk larger than the call.
const std::vector<int64_t> kChunkRows = {1, 3, 5, 0, 20};

TEST(ChunkedTargetLogprobsTest, Float64EqualsTheComposedPath) {
  const Inputs in = MakeInputs(torch::kDouble);
  const Result want = Composed(in);
  for (int64_t rows : kChunkRows) {
    SCOPED_TRACE("chunk_rows " + std::to_string(rows));
    const Result got = Chunked(in, rows);
    ASSERT_EQ(got.logprobs.sizes(), want.logprobs.sizes());
    EXPECT_EQ(got.logprobs.scalar_type(), torch::kDouble);
    EXPECT_LE(MaxAbsDiff(got.logprobs, want.logprobs), 1e-12);
    EXPECT_LE(MaxAbsDiff(got.grad_hidden, want.grad_hidden), 1e-12);
    EXPECT_LE(MaxAbsDiff(got.grad_weight, want.grad_weight), 1e-12);
  }
}

TEST(ChunkedTargetLogprobsTest, Float32MatchesTheComposedPath) {
  // Tolerance: float32 rounding of sums over V = 50 logits and 14 tokens.
  const Inputs in = MakeInputs(torch::kFloat);
  const Result want = Composed(in);
  for (int64_t rows : kChunkRows) {
    SCOPED_TRACE("chunk_rows " + std::to_string(rows));
    const Result got = Chunked(in, rows);
    EXPECT_EQ(got.logprobs.scalar_type(), torch::kFloat);
    EXPECT_LE(MaxAbsDiff(got.logprobs, want.logprobs), 1e-5);
    EXPECT_LE(MaxAbsDiff(got.grad_hidden, want.grad_hidden), 1e-5);
    EXPECT_LE(MaxAbsDiff(got.grad_weight, want.grad_weight), 1e-5);
  }
}

TEST(ChunkedTargetLogprobsTest, BFloat16MatchesTheComposedPath) {
  // The logits are the same bf16 products widened to float32, so the
  // log-probabilities agree to float32 rounding; the gradients are bf16 and
  // grad_weight is summed in float32 here where the composed path rounds a
  // bf16 product: within 2 bf16 ulps (2^-7 relative) of the largest entry.
  const Inputs in = MakeInputs(torch::kBFloat16);
  const Result want = Composed(in);
  for (int64_t rows : kChunkRows) {
    SCOPED_TRACE("chunk_rows " + std::to_string(rows));
    const Result got = Chunked(in, rows);
    EXPECT_EQ(got.logprobs.scalar_type(), torch::kFloat);
    EXPECT_EQ(got.grad_weight.scalar_type(), torch::kBFloat16);
    EXPECT_LE(MaxAbsDiff(got.logprobs, want.logprobs), 1e-5);
    EXPECT_LE(MaxAbsDiff(got.grad_hidden, want.grad_hidden),
              MaxAbs(want.grad_hidden) / 64);
    EXPECT_LE(MaxAbsDiff(got.grad_weight, want.grad_weight),
              MaxAbs(want.grad_weight) / 64);
  }
}

TEST(ChunkedTargetLogprobsTest, GradientMatchesFiniteDifferences) {
  // Central differences of L = sum(upstream * logprobs) in float64.
  const Inputs in = MakeInputs(torch::kDouble);
  const Result got = Chunked(in, 3);
  auto loss = [&](const torch::Tensor& h, const torch::Tensor& w) {
    torch::NoGradGuard no_grad;
    return (ChunkedTargetLogprobs(h, w, in.targets, 3) * in.upstream)
        .sum()
        .item<double>();
  };
  const double eps = 1e-6;
  const torch::Tensor h0 = in.hidden.detach(), w0 = in.weight.detach();
  for (int64_t i : {0, 17, 100, 223}) {
    torch::Tensor plus = h0.clone(), minus = h0.clone();
    plus.view({-1})[i] += eps;
    minus.view({-1})[i] -= eps;
    const double numeric = (loss(plus, w0) - loss(minus, w0)) / (2 * eps);
    EXPECT_NEAR(got.grad_hidden.view({-1})[i].item<double>(), numeric, 1e-7)
        << "hidden " << i;
  }
  for (int64_t i : {0, 31, 400, 799}) {
    torch::Tensor plus = w0.clone(), minus = w0.clone();
    plus.view({-1})[i] += eps;
    minus.view({-1})[i] -= eps;
    const double numeric = (loss(h0, plus) - loss(h0, minus)) / (2 * eps);
    EXPECT_NEAR(got.grad_weight.view({-1})[i].item<double>(), numeric, 1e-7)
        << "weight " << i;
  }
}

TEST(ChunkedTargetLogprobsTest, FrozenWeightGetsNoGradient) {
  const Inputs in = MakeInputs(torch::kDouble);
  const torch::Tensor hidden = in.hidden.detach().clone().requires_grad_();
  const torch::Tensor weight = in.weight.detach();
  (ChunkedTargetLogprobs(hidden, weight, in.targets, 4) * in.upstream)
      .sum()
      .backward();
  EXPECT_FALSE(weight.grad().defined());
  EXPECT_LE(MaxAbsDiff(hidden.grad(), Composed(in).grad_hidden), 1e-12);
}

TEST(ChunkedTargetLogprobsTest, BadInputNamesTheOperand) {
  const Inputs in = MakeInputs(torch::kFloat);
  const torch::Tensor h = in.hidden.detach(), w = in.weight.detach();
  auto message = [](auto call) {
    try {
      call();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] {
              ChunkedTargetLogprobs(h, w.narrow(1, 0, 8), in.targets);
            }).find("must share H"),
            std::string::npos);
  EXPECT_NE(message([&] {
              ChunkedTargetLogprobs(h, w.to(torch::kDouble), in.targets);
            }).find("share a floating dtype"),
            std::string::npos);
  EXPECT_NE(message([&] {
              ChunkedTargetLogprobs(h, w, in.targets.view({-1}));
            }).find("targets must be int64 shaped"),
            std::string::npos);
  EXPECT_NE(message([&] {
              ChunkedTargetLogprobs(h, w, in.targets + kVocab);
            }).find("targets must lie in [0, 50)"),
            std::string::npos);
  EXPECT_NE(message([&] {
              ChunkedTargetLogprobs(h, w, in.targets, -1);
            }).find("chunk_rows must be >= 0"),
            std::string::npos);
}

}  // namespace
}  // namespace tally::kernels
