// The loss seam: cross-entropy through TokenLoss is the weighted negative
// log-likelihood of the valid tokens (checked against a plain loop over the
// samples), and a loss's named per-token inputs travel with their tokens
// through packing and the context-parallel split, and are validated.
#include "runtime/train/token_loss.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "runtime/train/context_parallel.h"
#include "runtime/train/loss.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

// -scale_t * log p_t: a loss that reads the named per-token input "scale".
class ScaledLoss final : public TokenLoss {
 public:
  std::string name() const override { return "scaled"; }
  std::vector<std::string> required_inputs() const override {
    return {"scale"};
  }
  torch::Tensor TokenLosses(const torch::Tensor& target_logprobs,
                            const PackedBatch& batch) const override {
    return (-target_logprobs).masked_fill(~batch.valid, 0.0) *
           batch.token_inputs.at("scale");
  }
};

std::vector<Sample> Samples() {
  std::vector<Sample> samples(3);
  samples[0] = {{1, 2, 3, 4, 5}, {2, 3, -100, 5, 6}, {1, 2, 9, 0.5f, 1}, {}};
  samples[1] = {{7, 8}, {8, 9}, {}, {}};
  samples[2] = {{3, 3, 3, 3, 3, 3, 3}, {3, -100, 3, 3, 3, 3, 3}, {}, {}};
  const std::vector<std::vector<float>> scales = {
      {0.5f, -1, 2, 3, 0}, {4, -0.25f}, {1, 2, 3, 4, 5, 6, 7}};
  for (size_t i = 0; i < samples.size(); ++i) {
    samples[i].token_inputs["scale"] = scales[i];
  }
  return samples;
}

// Random log-probabilities for `batch`, one per (row, position).
torch::Tensor Logprobs(const PackedBatch& batch) {
  torch::manual_seed(7);
  return -torch::rand(batch.inputs.sizes(), torch::kFloat64) * 3;
}

TEST(TokenLossTest, CrossEntropyIsTheWeightedNllOfTheValidTokens) {
  const std::vector<Sample> samples = Samples();
  const PackedBatch batch = PackRows(samples, {0, 1, 2}, torch::kFloat64);
  const torch::Tensor logprobs = Logprobs(batch);
  auto lp = logprobs.accessor<double, 2>();
  double token_sum = 0, sample_mean_sum = 0;
  for (int r = 0; r < 3; ++r) {
    const Sample& s = samples[r];
    double sum = 0;
    int valid = 0;
    for (size_t t = 0; t < s.input_tokens.size(); ++t) {
      const double w = s.weights.empty() ? 1.0 : s.weights[t];
      if (s.target_tokens[t] == kIgnoreIndex || w <= 0) continue;
      sum += -w * lp[r][t];
      ++valid;
    }
    token_sum += sum;
    sample_mean_sum += sum / valid;
  }
  const CrossEntropyLoss loss;
  EXPECT_NEAR(ComputeLoss(loss, logprobs, batch, LossReduction::kSum)
                  .raw_loss.item<double>(),
              token_sum, 1e-12);
  EXPECT_NEAR(ComputeLoss(loss, logprobs, batch, LossReduction::kSampleMean)
                  .raw_loss.item<double>(),
              sample_mean_sum, 1e-12);
  // The default loss is cross-entropy.
  EXPECT_EQ(DefaultTokenLoss().name(), "cross_entropy");
  EXPECT_TRUE(torch::equal(
      ComputeLoss(logprobs, batch, LossReduction::kSum).raw_loss,
      ComputeLoss(loss, logprobs, batch, LossReduction::kSum).raw_loss));
}

TEST(TokenLossTest, NamedInputsTravelThroughPackingAndTheCpSplit) {
  const std::vector<Sample> samples = Samples();
  const PackedBatch full = PackRows(samples, {0, 1, 2}, torch::kFloat64);
  ASSERT_EQ(full.token_inputs.count("scale"), 1u);
  EXPECT_EQ(full.token_inputs.at("scale")[1][1].item<double>(), -0.25);
  EXPECT_EQ(full.token_inputs.at("scale")[1][4].item<double>(), 0.0);  // pad
  const torch::Tensor logprobs = Logprobs(full);
  const ScaledLoss loss;
  const double whole = ComputeLoss(loss, logprobs, full, LossReduction::kSum)
                           .raw_loss.item<double>();
  // Each cp rank scores its own tokens: the parts add up to the whole.
  for (int cp = 2; cp <= 3; ++cp) {
    double parts = 0;
    for (int rank = 0; rank < cp; ++rank) {
      const ContextParallelBatch split =
          SplitForContextParallel(full, rank, cp);
      const torch::Tensor positions =
          split.layout.positions.clamp_max(full.inputs.size(1) - 1);
      const torch::Tensor mine = logprobs.gather(1, positions);
      parts += ComputeLoss(loss, mine, split.local, LossReduction::kSum)
                   .raw_loss.item<double>();
    }
    EXPECT_NEAR(parts, whole, 1e-12) << "cp " << cp;
  }
}

TEST(TokenLossTest, InputsAreValidatedNamingTheField) {
  std::vector<Sample> samples = Samples();
  const ScaledLoss loss;
  EXPECT_TRUE(ValidateLossInputs(loss, samples).ok());
  EXPECT_TRUE(ValidateLossInputs(CrossEntropyLoss(), samples).ok());
  samples[1].token_inputs.clear();
  const absl::Status missing = ValidateLossInputs(loss, samples);
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(missing.message()),
              HasSubstr("samples[1].scale is required by "
                        "the scaled loss"));

  LlamaConfig config;
  config.vocab_size = 16;
  config.max_position_embeddings = 64;
  samples = Samples();
  samples[2].token_inputs["scale"].pop_back();
  EXPECT_THAT(std::string(ValidateSamples(config, samples).message()),
              HasSubstr("samples[2].scale has 6 entries"));
  samples = Samples();
  samples[0].token_inputs["scale"][3] = std::nanf("");
  EXPECT_THAT(std::string(ValidateSamples(config, samples).message()),
              HasSubstr("samples[0].scale[3] = nan must be "
                        "finite"));
}

}  // namespace
}  // namespace tally
