#include "tests/testing/test_util.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <random>

#include "runtime/io/safetensors_header.h"

namespace tally::testing {

LlamaConfig TinyConfig(bool tie_word_embeddings, int64_t num_hidden_layers) {
  LlamaConfig c;
  c.vocab_size = 48;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = num_hidden_layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  c.max_position_embeddings = 512;
  c.tie_word_embeddings = tie_word_embeddings;
  return c;
}

std::string SmallConfigJson(const std::string& model_type,
                            const nlohmann::json& extra) {
  nlohmann::json j = {{"model_type", model_type}, {"vocab_size", 64},
                      {"hidden_size", 32},        {"intermediate_size", 48},
                      {"num_hidden_layers", 2},   {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}};
  j.update(extra);
  return j.dump();
}

Sample MakeSample(int64_t vocab, int length, int valid, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(0,
                                               static_cast<int32_t>(vocab) - 1);
  std::uniform_real_distribution<float> weight(0.5f, 1.5f);
  Sample s;
  s.input_tokens.resize(length);
  s.target_tokens.resize(length);
  s.weights.resize(length);
  for (int t = 0; t < length; ++t) {
    s.input_tokens[t] = token(rng);
    s.target_tokens[t] = token(rng);
    s.weights[t] = weight(rng);
  }
  // Spread the valid positions over the sample; invalidate the rest, half by
  // -100 and half by weight 0, so both ways of ignoring are exercised.
  std::vector<int> positions(length);
  for (int t = 0; t < length; ++t) positions[t] = t;
  std::shuffle(positions.begin(), positions.end(), rng);
  for (int i = valid; i < length; ++i) {
    if (i % 2 == 0) {
      s.target_tokens[positions[i]] = kIgnoreIndex;
    } else {
      s.weights[positions[i]] = 0.0f;
    }
  }
  return s;
}

std::vector<Sample> MakeSamples(int64_t vocab,
                                const std::vector<int>& valid_per_sample,
                                uint64_t seed) {
  std::vector<Sample> out;
  for (size_t i = 0; i < valid_per_sample.size(); ++i) {
    const int valid = valid_per_sample[i];
    const int length = std::max(1, valid + static_cast<int>((seed + i) % 5));
    out.push_back(MakeSample(vocab, length, valid, seed * 1000 + i));
  }
  return out;
}

Sample MakeSampleValidAt(int64_t vocab, int length,
                         const std::vector<int>& valid_positions,
                         uint64_t seed) {
  Sample s = MakeSample(vocab, length, length, seed);
  std::vector<int32_t> targets(length, kIgnoreIndex);
  for (int t : valid_positions) targets.at(t) = s.target_tokens[t];
  s.target_tokens = std::move(targets);
  return s;
}

void AddPolicyInputs(std::vector<Sample>& samples, double logprob,
                     uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (Sample& s : samples) {
    const size_t n = s.input_tokens.size();
    std::vector<float>& advantages = s.token_inputs[kAdvantages];
    std::vector<float>& sampling = s.token_inputs[kSamplingLogprobs];
    advantages.resize(n);
    sampling.resize(n);
    if (s.weights.empty()) s.weights.assign(n, 1.0f);
    for (size_t t = 0; t < n; ++t) {
      advantages[t] = unit(rng);
      sampling[t] = static_cast<float>(logprob + 0.5 * unit(rng));
      if (t % 3 == 2) s.weights[t] = -s.weights[t];
    }
  }
}

ModelSpec TinySpec(const std::string& id, DType dtype, OptimizerKind optimizer,
                   uint64_t seed) {
  ModelSpec spec;
  spec.model_id = id;
  spec.config = TinyConfig();
  spec.seed = seed;
  spec.dtype = dtype;
  spec.optimizer = optimizer;
  spec.default_adam.learning_rate = 1e-2;
  spec.default_adam.weight_decay = 0.1;
  return spec;
}

LoraConfig TestLora() {
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.train_attn = true;
  lora.train_mlp = true;
  lora.train_unembed = true;
  lora.seed = 99;
  return lora;
}

LlamaConfig MoeConfig(LlamaConfig config) {
  config.num_local_experts = 4;
  config.num_experts_per_tok = 2;
  config.router_aux_loss_coef = 0.02;
  config.output_router_logits = true;
  return config;
}

LlamaConfig FamilyConfig(LlamaConfig config, const char* family) {
  if (family == nullptr) return config;
  config.model_type = family;
  config.sliding_window = 5;
  config.max_window_layers = 1;
  if (config.model_type == "qwen3") {
    config.head_dim = 12;
    config.attention_bias = true;
  }
  return config;
}

double RelativeDiff(const torch::Tensor& a, const torch::Tensor& b) {
  // On the host: a and b may live on different devices.
  torch::Tensor da = a.detach().to(torch::kCPU, torch::kFloat64);
  torch::Tensor db = b.detach().to(torch::kCPU, torch::kFloat64);
  const double scale = std::max(db.abs().max().item<double>(), 1e-300);
  return (da - db).abs().max().item<double>() / scale;
}

double RelativeDiff(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-300);
}

std::vector<torch::Tensor> ParameterValues(CausalLm& model) {
  std::vector<torch::Tensor> out;
  for (const Parameter& p : model.parameters()) {
    out.push_back(p.tensor.detach().clone());
  }
  return out;
}

std::vector<torch::Tensor> Gradients(CausalLm& model) {
  std::vector<torch::Tensor> out;
  for (const Parameter& p : model.parameters()) {
    const torch::Tensor& g = p.tensor.grad();
    out.push_back(g.defined() ? g.detach().clone()
                              : torch::zeros_like(p.tensor));
  }
  return out;
}

bool AllEqual(const std::vector<torch::Tensor>& a,
              const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

double GoldenTolerance(DType dtype) {
  return dtype == DType::kFloat64 ? 1e-10 : 1e-5;
}

bool WriteSparseSafetensors(const std::string& path, const std::string& name,
                            const std::vector<int64_t>& shape) {
  uint64_t bytes = sizeof(float);
  for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
  const std::string header = EncodeSafetensorsHeader(
      {{name, SafetensorsDType::kF32, shape, 0, bytes}}, {});
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!(out << header)) return false;
  }
  return ::truncate(path.c_str(), static_cast<off_t>(header.size() + bytes)) ==
         0;
}

}  // namespace tally::testing
