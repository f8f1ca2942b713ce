// Decoding with a KV cache (runtime/model/kv_cache.h, runtime/sample/decode.h):
// the logits of every position decoded through the cache equal one full forward
// over the whole sequence, for each family's features (GQA, rope scaling, tied
// embeddings, biases, qwen3's q/k norms, sliding windows, MoE, LoRA, the
// blocked attention path) and a batch of different prompt lengths from which
// a sequence leaves; a sampled token's log-probability equals the training
// forward's; greedy decoding equals the HF-faithful reference of
// tests/python/hf_reference.py token for token.
#include "runtime/model/kv_cache.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "runtime/checkpoint/weights_export.h"
#include "runtime/model/llama_model.h"
#include "runtime/sample/decode.h"
#include "tests/testing/hf_reference.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

namespace fs = std::filesystem;
using testing::RelativeDiff;

const auto kI64 = torch::TensorOptions().dtype(torch::kInt64);

struct Case {
  std::string name;
  LlamaConfig config;
  bool lora = false;
  bool blocked = false;  // blocked attention, 4 keys per block
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::vector<Case> Cases() {
  using testing::FamilyConfig;
  using testing::TinyConfig;
  LlamaConfig mistral = FamilyConfig(TinyConfig(), "mistral");
  mistral.max_window_layers = 0;  // Qwen's field; every layer slides
  LlamaConfig llama3 = TinyConfig(/*tie_word_embeddings=*/true);
  // Wavelengths 2π·{1, 10, 100, 1000}: one in the interpolated band (2, 8),
  // the others scaled or kept.
  llama3.rope_scaling = {"llama3", 8.0, 1.0, 4.0, 8};
  LlamaConfig linear = FamilyConfig(TinyConfig(), "qwen2");
  linear.rope_scaling = {"linear", 2.0};
  return {
      {"llama", TinyConfig()},
      {"llama_tied_llama3_rope", llama3},
      {"qwen2_linear_rope", linear},
      {"qwen3", FamilyConfig(TinyConfig(), "qwen3")},
      {"mistral", mistral},
      {"mixtral", testing::MoeConfig()},
      {"llama_lora", TinyConfig(), /*lora=*/true},
      {"qwen3_blocked", FamilyConfig(TinyConfig(), "qwen3"), false,
       /*blocked=*/true},
  };
}

// Weights far from a fresh model's near-uniform logits, as hf_reference.py's
// random_weights: norms 1 + N(0, 0.1²), biases N(0, 0.1²), the embedding
// N(0, 0.3²), every matrix N(0, 1 / fan_in) (LoRA's B too, so adapters act).
// The same draws (in float64) for every dtype.
void Randomize(CausalLm& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  torch::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (Parameter& p : model.parameters()) {
    torch::Tensor r = torch::randn(p.tensor.sizes(), generator,
                                   torch::TensorOptions(torch::kFloat64));
    if (absl::EndsWith(p.name, "norm.weight")) {
      r = 1 + 0.1 * r;
    } else if (absl::EndsWith(p.name, ".bias")) {
      r = 0.1 * r;
    } else if (p.name == "model.embed_tokens.weight") {
      r = 0.3 * r;
    } else {
      r = r / std::sqrt(static_cast<double>(p.tensor.size(-1)));
    }
    p.tensor.copy_(r);
  }
}

std::unique_ptr<LlamaModel> MakeModel(const Case& c, DType dtype) {
  ModelAdapters adapters;
  if (c.lora) adapters.lora = testing::TestLora();
  std::unique_ptr<LlamaModel> model =
      LlamaModel::Create(c.config, dtype, 7, {}, adapters).value();
  Randomize(*model, 11);
  if (c.blocked) model->set_attention({AttentionMode::kBlocked, 4});
  return model;
}

// Right-padded rows of `sequences` (padding: token vocab - 1, never read)
// and their positions and validity.
struct Padded {
  torch::Tensor tokens, positions, valid;
};
Padded Pad(const std::vector<std::vector<int64_t>>& sequences, int64_t vocab) {
  int64_t longest = 0;
  for (const auto& s : sequences) {
    longest = std::max<int64_t>(longest, s.size());
  }
  const int64_t batch = static_cast<int64_t>(sequences.size());
  Padded padded;
  padded.tokens = torch::full({batch, longest}, vocab - 1, kI64);
  padded.positions = torch::arange(longest, kI64).expand({batch, longest});
  padded.valid = torch::zeros({batch, longest}, torch::kBool);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = static_cast<int64_t>(sequences[b].size());
    padded.tokens[b].narrow(0, 0, n).copy_(torch::tensor(sequences[b], kI64));
    padded.valid[b].narrow(0, 0, n).fill_(true);
  }
  return padded;
}

// The training forward's log-softmax [B, T, V] of right-padded `sequences`:
// TargetLogprobs with every target set to each vocabulary id in turn.
torch::Tensor FullForwardLogSoftmax(
    CausalLm& model, const std::vector<std::vector<int64_t>>& sequences) {
  torch::NoGradGuard no_grad;
  const int64_t vocab = model.config().vocab_size;
  const Padded padded = Pad(sequences, vocab);
  std::vector<int64_t> lengths;
  for (const auto& s : sequences) lengths.push_back(s.size());
  const AttentionLayout layout =
      AttentionLayout::RightPadded(lengths, padded.tokens.size(1));
  std::vector<torch::Tensor> columns;
  for (int64_t v = 0; v < vocab; ++v) {
    columns.push_back(model.TargetLogprobs(
        padded.tokens, torch::full_like(padded.tokens, v), layout));
  }
  return torch::stack(columns, -1);
}

std::vector<std::vector<int64_t>> RandomSequences(
    const std::vector<int64_t>& lengths, int64_t vocab, uint64_t seed) {
  torch::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<std::vector<int64_t>> out;
  for (int64_t n : lengths) {
    torch::Tensor t = torch::randint(vocab, {n}, generator, kI64);
    out.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  }
  return out;
}

// Runs `sequences` through a cache: their first prompt_lengths[b] tokens in
// one right-padded prefill, then one token per step per row; row `leaver`
// leaves the batch after `leave_after` steps. Returns each sequence's logits
// [length, V] at every position.
std::vector<torch::Tensor> CachedLogits(
    CausalLm& model, const std::vector<std::vector<int64_t>>& sequences,
    const std::vector<int64_t>& prompt_lengths, int64_t leaver,
    int64_t leave_after) {
  const int64_t batch = static_cast<int64_t>(sequences.size());
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t b = 0; b < batch; ++b) {
    prompts.emplace_back(sequences[b].begin(),
                         sequences[b].begin() + prompt_lengths[b]);
  }
  // Capacity 4: the cache grows during the prefill and again later.
  KvCache cache(model.config().num_hidden_layers, 4);
  const Padded padded = Pad(prompts, model.config().vocab_size);
  const torch::Tensor prefill =
      model
          .ForwardWithCache(padded.tokens, padded.positions, padded.valid,
                            cache, /*logits_at=*/torch::Tensor())
          .value();
  std::vector<std::vector<torch::Tensor>> rows(batch);
  for (int64_t b = 0; b < batch; ++b) {
    rows[b].push_back(prefill[b].narrow(0, 0, prompt_lengths[b]));
  }
  std::vector<int64_t> active(batch);
  std::iota(active.begin(), active.end(), 0);
  for (int64_t step = 0;; ++step) {
    if (step == leave_after) {
      std::vector<int64_t> kept;
      for (int64_t r = 0; r < static_cast<int64_t>(active.size()); ++r) {
        if (active[r] != leaver) kept.push_back(r);
      }
      cache.KeepRows(torch::tensor(kept, kI64));
      active.erase(std::find(active.begin(), active.end(), leaver));
    }
    std::vector<int64_t> next, positions;
    for (int64_t b : active) {
      const int64_t position = prompt_lengths[b] + step;
      if (position >= static_cast<int64_t>(sequences[b].size())) return {};
      next.push_back(sequences[b][position]);
      positions.push_back(position);
    }
    const int64_t rows_now = static_cast<int64_t>(active.size());
    const torch::Tensor logits =
        model
            .ForwardWithCache(torch::tensor(next, kI64).unsqueeze(1),
                              torch::tensor(positions, kI64).unsqueeze(1),
                              torch::ones({rows_now, 1}, torch::kBool), cache,
                              /*logits_at=*/torch::Tensor())
            .value();
    bool done = true;
    for (int64_t r = 0; r < rows_now; ++r) {
      const int64_t b = active[r];
      rows[b].push_back(logits[r]);
      const int64_t have = prompt_lengths[b] + step + 1;
      done = done && have == static_cast<int64_t>(sequences[b].size());
    }
    if (done) break;
  }
  std::vector<torch::Tensor> out;
  for (auto& r : rows) out.push_back(torch::cat(r));
  return out;
}

class KvCacheTest : public ::testing::TestWithParam<Case> {};

// Prompts of 3, 7 and 5 tokens; the second leaves after 4 decoded tokens,
// the others run 9 steps (past qwen3's and mistral's window of 5).
TEST_P(KvCacheTest, CachedLogitsEqualTheFullForward) {
  const std::vector<int64_t> prompts = {3, 7, 5};
  const std::vector<int64_t> lengths = {3 + 9, 7 + 4, 5 + 9};
  // fp64 exact; fp32 the golden tolerance. bf16 (mixed precision): the
  // cached path's largest distance to the bf16 full forward within twice
  // the largest distance of that forward to the fp64 one (both paths round
  // alike; measured: at most 0.92 of it over these cases).
  double bf16_cached_error = 0, bf16_error = 0;
  torch::Tensor exact;
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::unique_ptr<LlamaModel> model = MakeModel(GetParam(), dtype);
    const std::vector<std::vector<int64_t>> sequences =
        RandomSequences(lengths, model->config().vocab_size, 3);
    const std::vector<torch::Tensor> cached =
        CachedLogits(*model, sequences, prompts, /*leaver=*/1,
                     /*leave_after=*/4);
    ASSERT_EQ(cached.size(), sequences.size());
    const torch::Tensor full = FullForwardLogSoftmax(*model, sequences);
    if (dtype == DType::kFloat64) exact = full;
    // The raw logits too: a prefill of the whole sequences.
    KvCache fresh(model->config().num_hidden_layers, 16);
    const Padded padded = Pad(sequences, model->config().vocab_size);
    const torch::Tensor full_logits =
        model
            ->ForwardWithCache(padded.tokens, padded.positions, padded.valid,
                               fresh, /*logits_at=*/torch::Tensor())
            .value();
    // Only each sequence's last position (what a prefill asks for): the
    // same rows as the full logits'.
    KvCache last_only(model->config().num_hidden_layers, 16);
    const torch::Tensor last = torch::tensor(lengths, kI64) - 1;
    const torch::Tensor last_logits =
        model
            ->ForwardWithCache(padded.tokens, padded.positions, padded.valid,
                               last_only, last)
            .value();
    ASSERT_EQ(last_logits.size(1), 1);
    for (size_t b = 0; b < sequences.size(); ++b) {
      SCOPED_TRACE(b);
      const int64_t n = lengths[b];
      ASSERT_EQ(cached[b].size(0), n);
      const torch::Tensor got = torch::log_softmax(cached[b], -1);
      const torch::Tensor want = full[b].narrow(0, 0, n);
      if (dtype == DType::kBFloat16) {
        bf16_cached_error =
            std::max(bf16_cached_error, RelativeDiff(got, want));
        bf16_error =
            std::max(bf16_error, RelativeDiff(want, exact[b].narrow(0, 0, n)));
      } else {
        EXPECT_LE(RelativeDiff(got, want), testing::GoldenTolerance(dtype));
        EXPECT_LE(RelativeDiff(cached[b], full_logits[b].narrow(0, 0, n)),
                  testing::GoldenTolerance(dtype));
        EXPECT_LE(
            RelativeDiff(last_logits[b][0], full_logits[b][lengths[b] - 1]),
            testing::GoldenTolerance(dtype));
      }
    }
  }
  EXPECT_LE(bf16_cached_error, 2 * bf16_error);
  // The bf16 bound is no bound at all if bf16 were exact here.
  EXPECT_GT(bf16_error, 1e-4);
}

// A sampled token's log-probability is the training forward's log-probability
// of the completed sequence at that token (fp64, 1e-10). A stop token taken
// from one sequence's free run ends the sequences that draw it (they leave
// the batch then) and leaves the others to run to max_tokens.
TEST_P(KvCacheTest, SampledLogprobsEqualTheTrainingForward) {
  std::unique_ptr<LlamaModel> model = MakeModel(GetParam(), DType::kFloat64);
  const int64_t vocab = model->config().vocab_size;
  DecodeRequest request;
  request.prompts = RandomSequences({3, 7, 5, 1}, vocab, 4);
  request.max_tokens = 10;
  request.sampling = {0.9, 0.95, 20};
  request.seed = 17;
  const std::vector<DecodedSequence> free = Decode(*model, request).value();
  // A token of sequence 0 that some other sequence never draws.
  auto drew = [&](size_t i, int64_t token) {
    return std::count(free[i].tokens.begin(), free[i].tokens.end(), token) > 0;
  };
  int64_t stop = -1;
  for (int64_t token : free[0].tokens) {
    for (size_t i = 1; i < free.size() && stop < 0; ++i) {
      if (!drew(i, token)) stop = token;
    }
  }
  ASSERT_GE(stop, 0);
  request.stop = {{stop}};
  const std::vector<DecodedSequence> decoded = Decode(*model, request).value();
  ASSERT_EQ(decoded.size(), request.prompts.size());
  std::vector<std::vector<int64_t>> sequences;
  for (size_t i = 0; i < decoded.size(); ++i) {
    SCOPED_TRACE(i);
    const std::vector<int64_t>& all = free[i].tokens;
    ASSERT_EQ(all.size(), 10u);
    const auto end = std::find(all.begin(), all.end(), stop);
    const std::vector<int64_t> expected(all.begin(),
                                        end == all.end() ? end : end + 1);
    EXPECT_EQ(decoded[i].tokens, expected);
    EXPECT_EQ(decoded[i].stop_reason,
              drew(i, stop) ? StopReason::kStop : StopReason::kLength);
    ASSERT_EQ(decoded[i].logprobs.size(), decoded[i].tokens.size());
    sequences.push_back(request.prompts[i]);
    sequences.back().insert(sequences.back().end(), decoded[i].tokens.begin(),
                            decoded[i].tokens.end());
  }
  const torch::Tensor full = FullForwardLogSoftmax(*model, sequences);
  for (size_t i = 0; i < decoded.size(); ++i) {
    const int64_t prompt = static_cast<int64_t>(request.prompts[i].size());
    for (size_t j = 0; j < decoded[i].tokens.size(); ++j) {
      const double want =
          full[i][prompt + j - 1][decoded[i].tokens[j]].item<double>();
      EXPECT_LE(RelativeDiff(decoded[i].logprobs[j], want), 1e-10)
          << "sequence " << i << " token " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, KvCacheTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// A sequence's tokens do not depend on the prompts after it in the call, and
// the same seed gives the same tokens.
TEST(DecodeTest, ASequencesTokensIgnoreTheRestOfTheCall) {
  std::unique_ptr<LlamaModel> model =
      MakeModel({"llama", testing::TinyConfig()}, DType::kFloat64);
  DecodeRequest request;
  request.prompts = RandomSequences({4, 2, 6}, model->config().vocab_size, 8);
  request.max_tokens = 12;
  request.sampling = {1.0, 1.0, -1};
  request.seed = 5;
  const std::vector<DecodedSequence> all = Decode(*model, request).value();
  EXPECT_EQ(Decode(*model, request).value()[2].tokens, all[2].tokens);
  request.prompts.pop_back();
  const std::vector<DecodedSequence> fewer = Decode(*model, request).value();
  EXPECT_EQ(fewer[0].tokens, all[0].tokens);
  EXPECT_EQ(fewer[1].tokens, all[1].tokens);
  request.seed = 6;
  EXPECT_NE(Decode(*model, request).value()[0].tokens, all[0].tokens);
}

// A stop sequence of several tokens ends a sequence at its first
// occurrence, and stays in its tokens.
TEST(DecodeTest, StopsAtTheFirstStopSequence) {
  std::unique_ptr<LlamaModel> model =
      MakeModel({"llama", testing::TinyConfig()}, DType::kFloat64);
  DecodeRequest request;
  request.prompts = RandomSequences({4, 6}, model->config().vocab_size, 9);
  request.max_tokens = 12;
  request.sampling.temperature = 0;
  const std::vector<DecodedSequence> free = Decode(*model, request).value();
  ASSERT_EQ(free[1].tokens.size(), 12u);
  EXPECT_EQ(free[1].stop_reason, StopReason::kLength);
  // Sequence 1's tokens 5 and 6 as the stop sequence: it ends at the first
  // place they occur together; sequence 0 is unaffected unless it holds
  // them too.
  const std::vector<int64_t> stop = {free[1].tokens[5], free[1].tokens[6]};
  size_t end = 2;
  while (
      !std::equal(stop.begin(), stop.end(), free[1].tokens.begin() + end - 2)) {
    ++end;
  }
  request.stop = {{model->config().vocab_size - 1, 0}, stop};
  const std::vector<DecodedSequence> stopped = Decode(*model, request).value();
  EXPECT_EQ(stopped[1].stop_reason, StopReason::kStop);
  EXPECT_EQ(stopped[1].tokens,
            std::vector<int64_t>(free[1].tokens.begin(),
                                 free[1].tokens.begin() + end));
  ASSERT_EQ(stopped[1].logprobs.size(), end);
  for (size_t j = 0; j < end; ++j) {
    EXPECT_LE(RelativeDiff(stopped[1].logprobs[j], free[1].logprobs[j]), 1e-12);
  }
  EXPECT_EQ(stopped[0].tokens.size() < free[0].tokens.size(),
            stopped[0].stop_reason == StopReason::kStop);
}

TEST(DecodeTest, RefusesBadRequestsByField) {
  std::unique_ptr<LlamaModel> model =
      MakeModel({"llama", testing::TinyConfig()}, DType::kFloat64);
  const int64_t vocab = model->config().vocab_size;
  auto refused = [&](DecodeRequest request, const std::string& field) {
    const absl::Status status = Decode(*model, request).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_TRUE(absl::StrContains(status.message(), field)) << status.message();
  };
  DecodeRequest good;
  good.prompts = {{1, 2}};
  EXPECT_TRUE(Decode(*model, good).ok());
  DecodeRequest r = good;
  r.prompts = {};
  refused(r, "prompts");
  r = good;
  r.prompts = {{1}, {}};
  refused(r, "prompts[1]");
  r = good;
  r.prompts = {{1, vocab}};
  refused(r, "prompts[0][1]");
  r = good;
  r.prompts = {{-1}};
  refused(r, "prompts[0][0]");
  r = good;
  r.stop = {{2}, {}};
  refused(r, "stop[1]");
  r = good;
  r.max_tokens = 0;
  refused(r, "max_tokens");
  r = good;
  r.sampling.top_p = 0;
  refused(r, "top_p");
}

// A pipeline stage is not the whole model: decoding refuses it for now.
TEST(DecodeTest, RefusesASplitModel) {
  ModelSharding stage;
  stage.pp_stages = 2;
  std::unique_ptr<LlamaModel> model =
      LlamaModel::Create(testing::TinyConfig(), DType::kFloat64, 7, stage)
          .value();
  DecodeRequest request;
  request.prompts = {{1, 2}};
  EXPECT_EQ(Decode(*model, request).status().code(),
            absl::StatusCode::kUnimplemented);
}

// Greedy decoding equals the HF-faithful float64 reference
// (tests/python/hf_reference.py greedy) reading the model's weights export:
// the same tokens, and the same log-probabilities to 1e-10.
class GreedyReferenceTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::path(::testing::TempDir()) / "kv_cache_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string root_;
};

TEST_P(GreedyReferenceTest, EqualsTheReferenceTokenForToken) {
  if (!testing::ReferencePythonAvailable()) {
    GTEST_SKIP() << "the reference's python3 is not installed";
  }
  std::unique_ptr<LlamaModel> model = MakeModel(GetParam(), DType::kFloat64);
  const std::string dir = (fs::path(root_) / "model").string();
  ASSERT_TRUE(WriteWeightsExport(dir, *model, {}, "").ok());

  DecodeRequest request;
  request.prompts = RandomSequences({3, 7, 5}, model->config().vocab_size, 6);
  request.max_tokens = 12;
  request.sampling.temperature = 0;
  const std::vector<DecodedSequence> decoded = Decode(*model, request).value();

  const absl::StatusOr<std::vector<testing::ReferenceDecode>> reference =
      testing::ReferenceGreedy(dir, request.prompts, request.max_tokens,
                               "float64");
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_EQ(reference->size(), decoded.size());
  for (size_t i = 0; i < decoded.size(); ++i) {
    EXPECT_EQ(decoded[i].tokens, (*reference)[i].tokens) << "prompt " << i;
    const std::vector<double>& logprobs = (*reference)[i].logprobs;
    ASSERT_EQ(logprobs.size(), decoded[i].logprobs.size());
    for (size_t j = 0; j < logprobs.size(); ++j) {
      EXPECT_LE(RelativeDiff(decoded[i].logprobs[j], logprobs[j]), 1e-10)
          << "prompt " << i << " token " << j;
    }
  }
}

std::vector<Case> ReferenceCases() {
  std::vector<Case> cases;
  for (Case& c : Cases()) {
    if (!c.lora && !c.blocked) cases.push_back(std::move(c));
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Families, GreedyReferenceTest,
                         ::testing::ValuesIn(ReferenceCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// The cache's storage: a step writes its slots into the reserved capacity
// (the keys keep their address), the capacity doubles when a forward needs
// more, and the layout, keys and values a forward sees are every slot given
// so far, in order, also after a row leaves.
TEST(KvCacheStorageTest, StepsWriteInPlaceAndCapacityDoubles) {
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  KvCache cache(/*num_layers=*/1, /*capacity=*/4);
  const int64_t kv_heads = 2, d = 3;
  // What the cache must hold: everything appended, concatenated.
  torch::Tensor positions = torch::tensor({{0, 1, 2}, {0, 1, 2}}, kI64);
  torch::Tensor valid =
      torch::tensor({{true, true, true}, {true, true, false}});
  torch::Tensor keys = torch::randn({2, kv_heads, 3, d}, f64);
  torch::Tensor values = torch::randn({2, kv_heads, 3, d}, f64);
  AttentionLayout layout = cache.Extend(positions, valid);
  auto [k, v] = cache.Append(0, keys, values);
  // Slot bytes of both tensors: rows x kv_heads x d x 8 bytes x 2.
  const int64_t slot_bytes = 2 * kv_heads * d * 8 * 2;
  EXPECT_EQ(cache.bytes(), 4 * slot_bytes);
  const void* storage = k.data_ptr();
  std::vector<int64_t> capacities = {4};  // after the prefill
  for (int64_t step = 0; step < 10; ++step) {
    if (step == 6) {  // row 0 leaves
      const torch::Tensor rows = torch::tensor({int64_t{1}}, kI64);
      cache.KeepRows(rows);
      positions = positions.index_select(0, rows);
      valid = valid.index_select(0, rows);
      keys = keys.index_select(0, rows);
      values = values.index_select(0, rows);
      storage = nullptr;
    }
    const int64_t rows = positions.size(0);
    const torch::Tensor position = torch::full({rows, 1}, 3 + step, kI64);
    const torch::Tensor is_valid = torch::ones({rows, 1}, torch::kBool);
    const torch::Tensor new_keys = torch::randn({rows, kv_heads, 1, d}, f64);
    const torch::Tensor new_values = torch::randn({rows, kv_heads, 1, d}, f64);
    positions = torch::cat({positions, position}, 1);
    valid = torch::cat({valid, is_valid}, 1);
    keys = torch::cat({keys, new_keys}, 2);
    values = torch::cat({values, new_values}, 2);
    layout = cache.Extend(position, is_valid);
    std::tie(k, v) = cache.Append(0, new_keys, new_values);
    SCOPED_TRACE(step);
    EXPECT_EQ(cache.length(), 4 + step);
    EXPECT_TRUE(torch::equal(layout.positions, position));
    EXPECT_TRUE(torch::equal(layout.key_positions, positions));
    EXPECT_TRUE(torch::equal(layout.key_valid, valid));
    EXPECT_TRUE(torch::equal(k, keys));
    EXPECT_TRUE(torch::equal(v, values));
    const int64_t capacity = cache.bytes() / (slot_bytes / 2 * rows);
    if (storage != nullptr && capacity == capacities.back()) {
      EXPECT_EQ(k.data_ptr(), storage) << "a step moved the keys";
    }
    storage = k.data_ptr();
    capacities.push_back(capacity);
  }
  // 4 slots until the 5th, then 8 until the 9th, then 16.
  const std::vector<int64_t> expected = {4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 16};
  EXPECT_EQ(capacities, expected);
}

}  // namespace
}  // namespace tally
