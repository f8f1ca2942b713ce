// Shared helpers for tally's in-process tests: tiny model configs, sample
// builders with controlled valid-token counts, and tensor comparisons.
#ifndef TALLY_TESTS_TESTING_TEST_UTIL_H_
#define TALLY_TESTS_TESTING_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/config/llama_config.h"
#include "runtime/config/types.h"
#include "runtime/engine/engine.h"

namespace tally::testing {

// A 2-layer GQA Llama small enough for exact fp64 checks in milliseconds.
// `num_hidden_layers` = 4 serves pipeline tests of up to 4 stages.
LlamaConfig TinyConfig(bool tie_word_embeddings = false,
                       int64_t num_hidden_layers = 2);

// Four experts, two per token: in a one-token call two experts of every
// layer receive no token. With the load-balancing loss, whose gradient must
// not depend on how the tokens are split over ranks or devices either.
LlamaConfig MoeConfig(LlamaConfig config = TinyConfig());

// `config` as a model of `family` (nullptr: unchanged) with the family's
// features on: qwen2's q/k/v biases; qwen3's q/k norms with a head_dim of 12
// (not hidden / heads) and o bias; both with a sliding window of 5 on every
// layer but the first (samples of up to 120 tokens cross it).
LlamaConfig FamilyConfig(LlamaConfig config, const char* family);

// Rank 4, alpha 8 (scaling 2) on every projection and the unembedding, with
// A drawn from a seed of its own.
LoraConfig TestLora();

// The text of a small valid config.json of `model_type` (2 layers, GQA) with
// `extra` fields merged in: for tests of config.json reading.
std::string SmallConfigJson(const std::string& model_type,
                            const nlohmann::json& extra);

// One sample of `length` tokens from `rng`, of which exactly `valid` have a
// real target and a positive weight; the others are -100 or weight 0
// (alternating), and valid weights vary in (0.5, 1.5].
Sample MakeSample(int64_t vocab, int length, int valid, uint64_t seed);

// One sample of `length` tokens whose valid targets are exactly at
// `valid_positions` (the others are -100), with weights in (0.5, 1.5].
Sample MakeSampleValidAt(int64_t vocab, int length,
                         const std::vector<int>& valid_positions,
                         uint64_t seed);

// Samples whose valid counts are `valid_per_sample`, lengths valid + extra.
std::vector<Sample> MakeSamples(int64_t vocab,
                                const std::vector<int>& valid_per_sample,
                                uint64_t seed);

// Gives every sample the RL losses' inputs: advantages in [-1, 1] and
// sampling_logprobs of `logprob` + [-0.5, 0.5] (near a fresh model's
// logprobs: ratios fall inside and outside PPO's default clip range), and
// turns every third weight negative.
void AddPolicyInputs(std::vector<Sample>& samples, double logprob,
                     uint64_t seed);

ModelSpec TinySpec(const std::string& id, DType dtype, OptimizerKind optimizer,
                   uint64_t seed = 1234);

// max |a - b| / max(max |b|, tiny): one number per tensor pair.
double RelativeDiff(const torch::Tensor& a, const torch::Tensor& b);
double RelativeDiff(double a, double b);

// Copies of the current values / gradients of every parameter.
std::vector<torch::Tensor> ParameterValues(CausalLm& model);
std::vector<torch::Tensor> Gradients(CausalLm& model);

// Same length and every pair bitwise equal.
bool AllEqual(const std::vector<torch::Tensor>& a,
              const std::vector<torch::Tensor>& b);

// Tolerance of the golden comparisons for a dtype: 1e-10 (fp64), 1e-5 (fp32).
double GoldenTolerance(DType dtype);

// Parameters after an fp32 AdamW step with the default eps 1e-8:
// g / (sqrt(v) + eps) turns the fp32 rounding noise of small, cancelling
// gradient elements into update noise of the same relative size, so 1e-5 is
// no bound there. Measured: at most 1.7e-4 (the accumulation golden against
// its reference), 1.05e-4 across the multi-rank meshes; the bound keeps a 2x
// margin. Losses, gradients and norms keep GoldenTolerance.
inline constexpr double kFp32AdamParamTolerance = 4e-4;

// Writes a safetensors file at `path` whose header declares one float32
// tensor `name` of `shape`, its data a hole: the file is as large as the
// header says (64 GiB, say), on disk it is a few bytes. False when it cannot
// be written.
bool WriteSparseSafetensors(const std::string& path, const std::string& name,
                            const std::vector<int64_t>& shape);

}  // namespace tally::testing

#endif  // TALLY_TESTS_TESTING_TEST_UTIL_H_
