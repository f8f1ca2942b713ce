// Cast once (compute_weights.h): a bfloat16 model casts each float32 master
// to bfloat16 once and reuses the copy until the master changes, with
// gradients bitwise those of a cast at every use.
#include "runtime/model/compute_weights.h"

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <vector>

#include "runtime/model/attention_layout.h"
#include "runtime/model/causal_lm.h"
#include "runtime/model/kv_cache.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

const auto kF32 = torch::TensorOptions().dtype(torch::kFloat32);

// A weight read twice and a leaf behind it: each read's gradient is widened
// to float32 before the reads' gradients are added, as with a cast per read.
TEST(UseComputeCopyTest, GradientsAreThoseOfACastPerUse) {
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({5, 8}, kF32).to(torch::kBFloat16);
  const torch::Tensor w = torch::randn({8, 8}, kF32).requires_grad_();
  const torch::Tensor c = torch::randn({5, 8}, kF32).to(torch::kBFloat16);
  const auto loss = [&](const std::function<torch::Tensor()>& weight) {
    const torch::Tensor h = torch::linear(torch::linear(x, weight()), weight());
    return (h * c).to(torch::kFloat32).sum();
  };
  const torch::Tensor cast_loss = loss([&] { return w.to(torch::kBFloat16); });
  cast_loss.backward();
  const torch::Tensor cast_grad = w.grad().clone();
  w.mutable_grad() = torch::Tensor();

  ComputeWeights copies;
  const torch::Tensor once_loss = loss(
      [&] { return UseComputeCopy(w, copies.CopyOf(0, w, torch::kBFloat16)); });
  once_loss.backward();
  EXPECT_TRUE(torch::equal(once_loss, cast_loss));
  EXPECT_EQ(w.grad().scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(w.grad(), cast_grad));
}

TEST(UseComputeCopyTest, WithoutAutogradTheCopyItself) {
  const torch::Tensor w = torch::randn({3, 3}, kF32).requires_grad_();
  const torch::Tensor copy = w.detach().to(torch::kBFloat16);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(UseComputeCopy(w, copy).is_same(copy));
}

// The copy is made once, and made again after an in-place write (the
// version counter), new storage (set_data) or Invalidate.
TEST(ComputeWeightsTest, RemadeExactlyWhenTheMasterChanges) {
  torch::Tensor w = torch::randn({4, 6}, kF32);
  ComputeWeights copies;
  const torch::Tensor first = copies.CopyOf(2, w, torch::kBFloat16);
  EXPECT_TRUE(torch::equal(first, w.to(torch::kBFloat16)));
  EXPECT_TRUE(copies.CopyOf(2, w, torch::kBFloat16).is_same(first));
  EXPECT_EQ(copies.bytes(), 4 * 6 * 2);

  w.mul_(3);
  const torch::Tensor written = copies.CopyOf(2, w, torch::kBFloat16);
  EXPECT_TRUE(torch::equal(written, w.to(torch::kBFloat16)));
  EXPECT_FALSE(torch::equal(written, first));

  w.set_data(torch::randn({4, 6}, kF32));
  const torch::Tensor replaced = copies.CopyOf(2, w, torch::kBFloat16);
  EXPECT_TRUE(torch::equal(replaced, w.to(torch::kBFloat16)));

  // A write LibTorch does not see (a raw-pointer kernel), then Invalidate.
  w.data_ptr<float>()[0] = 1024.0f;
  EXPECT_TRUE(copies.CopyOf(2, w, torch::kBFloat16).is_same(replaced));
  copies.Invalidate();
  const torch::Tensor invalidated = copies.CopyOf(2, w, torch::kBFloat16);
  EXPECT_FALSE(invalidated.is_same(replaced));
  EXPECT_EQ(invalidated[0][0].item<float>(), 1024.0f);
  EXPECT_EQ(copies.bytes(), 4 * 6 * 2);
}

struct Batch {
  torch::Tensor inputs, targets;
  AttentionLayout layout;
};

Batch MakeBatch(int64_t vocab) {
  torch::manual_seed(9);
  Batch b;
  b.inputs = torch::randint(vocab, {2, 6}, torch::kInt64);
  b.targets = torch::randint(vocab, {2, 6}, torch::kInt64);
  b.layout = AttentionLayout::RightPadded({6, 4}, 6);
  return b;
}

// The loss and every gradient of one forward and backward.
std::vector<torch::Tensor> LossAndGradients(CausalLm& model, const Batch& b) {
  for (Parameter& p : model.parameters())
    p.tensor.mutable_grad() = torch::Tensor();
  const torch::Tensor loss =
      model.TargetLogprobs(b.inputs, b.targets, b.layout).sum();
  loss.backward();
  std::vector<torch::Tensor> out = {loss.detach()};
  for (torch::Tensor& g : testing::Gradients(model)) out.push_back(g);
  return out;
}

// A bf16 model holds one bf16 copy of each weight once a forward ran (a
// float32 model none); the copies are reused by later passes, with and
// without recomputation, and a write to a master reaches the next pass, whose
// results are then those of a model built with the written weights.
TEST(CastOnceModelTest, CopiesAreReusedUntilAMasterIsWritten) {
  std::unique_ptr<CausalLm> fp32 =
      CreateCausalLm(testing::TinyConfig(), DType::kFloat32, 5).value();
  std::unique_ptr<CausalLm> model =
      CreateCausalLm(testing::TinyConfig(), DType::kBFloat16, 5).value();
  const Batch b = MakeBatch(model->config().vocab_size);
  EXPECT_EQ(model->ComputeWeightBytes(), 0);
  const std::vector<torch::Tensor> first = LossAndGradients(*model, b);
  LossAndGradients(*fp32, b);
  EXPECT_EQ(fp32->ComputeWeightBytes(), 0);
  int64_t numel = 0;
  for (const Parameter& p : model->parameters()) numel += p.tensor.numel();
  EXPECT_EQ(model->ComputeWeightBytes(), 2 * numel);

  EXPECT_TRUE(testing::AllEqual(LossAndGradients(*model, b), first));
  ASSERT_TRUE(model->set_recompute_layers(true).ok());
  EXPECT_TRUE(testing::AllEqual(LossAndGradients(*model, b), first));

  // Written in place, as a checkpoint load writes (LibTorch counts it) ...
  std::unique_ptr<CausalLm> fresh =
      CreateCausalLm(testing::TinyConfig(), DType::kBFloat16, 5).value();
  ASSERT_TRUE(fresh->set_recompute_layers(true).ok());
  const auto write = [&](const std::function<void(torch::Tensor&)>& change) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i) {
      change(model->parameters()[i].tensor);
      change(fresh->parameters()[i].tensor);
    }
  };
  write([](torch::Tensor& t) { t.mul_(1.5); });
  const std::vector<torch::Tensor> scaled = LossAndGradients(*model, b);
  EXPECT_FALSE(torch::equal(scaled[0], first[0]));
  EXPECT_TRUE(testing::AllEqual(scaled, LossAndGradients(*fresh, b)));
  // ... and through raw pointers, which LibTorch does not see:
  // WeightsChanged.
  write([](torch::Tensor& t) {
    float* data = t.data_ptr<float>();
    for (int64_t j = 0; j < t.numel(); j += 3) data[j] *= 0.5f;
  });
  model->WeightsChanged();
  fresh->WeightsChanged();
  const std::vector<torch::Tensor> halved = LossAndGradients(*model, b);
  EXPECT_FALSE(torch::equal(halved[0], scaled[0]));
  EXPECT_TRUE(testing::AllEqual(halved, LossAndGradients(*fresh, b)));
  EXPECT_EQ(model->ComputeWeightBytes(), 2 * numel);
}

// Decoding reads the same copies: a cached forward's logits after a write
// are those of a model built with the written weights.
TEST(CastOnceModelTest, DecodingSeesWrittenWeights) {
  std::unique_ptr<CausalLm> model =
      CreateCausalLm(testing::TinyConfig(), DType::kBFloat16, 5).value();
  std::unique_ptr<CausalLm> fresh =
      CreateCausalLm(testing::TinyConfig(), DType::kBFloat16, 5).value();
  const Batch b = MakeBatch(model->config().vocab_size);
  const torch::Tensor positions =
      torch::arange(6, torch::kInt64).unsqueeze(0).repeat({2, 1});
  const torch::Tensor valid = torch::ones({2, 6}, torch::kBool);
  const auto logits = [&](CausalLm& m) {
    KvCache cache(m.config().num_hidden_layers, 8);
    return m
        .ForwardWithCache(b.inputs, positions, valid, cache, torch::Tensor())
        .value();
  };
  torch::NoGradGuard no_grad;
  const torch::Tensor before = logits(*model);
  EXPECT_TRUE(torch::equal(logits(*model), before));
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    model->parameters()[i].tensor.add_(0.01);
    fresh->parameters()[i].tensor.add_(0.01);
  }
  const torch::Tensor after = logits(*model);
  EXPECT_FALSE(torch::equal(after, before));
  EXPECT_TRUE(torch::equal(after, logits(*fresh)));
}

}  // namespace
}  // namespace tally
