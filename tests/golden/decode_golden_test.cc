// Golden tests of decoding on a mesh (runtime/sample/mesh_decode.h): real
// rank processes on loopback, each decoding with its shard of a model and,
// in the same process, with the single-rank model of the same weights, in
// float64, float32 and bfloat16 (mixed precision) in one launch. The weights
// are drawn far from a fresh model's near-uniform logits (DrawWeights), so
// that few greedy choices are near ties that rounding could flip.
//
// Requests: greedy and seeded sampling over prompts of different lengths of
// which one stops early (the ranks of a lockstep group finish unevenly), and
// a one-prompt call that leaves every data rank but one without a sequence.
// float64 and float32: every rank returns the single rank's tokens and stop
// reasons, greedy and seeded (so the same on every mesh). bfloat16: the mesh
// rounds differently from the single rank, so its greedy tokens are the
// single rank's up to each sequence's first near tie
// (ExpectSameGreedyBeforeANearTie); seeded bf16 tokens are not compared
// (a draw near a boundary of the distribution may go either way).
// Each returned log-probability equals the training forward's
// (CausalLm::TargetLogprobs, what ForwardBackward computes; the mesh's
// training forward equals the single rank's by multirank_golden_test.cc) of
// the completed sequence at that token: float64 within 1e-10 relative,
// float32 within GoldenTolerance, bfloat16 within kBf16DecodeFactor times the
// single rank's own bf16<->float32 distance (below). The prompts'
// log-probabilities with their top 3 (prompt_logprobs.h) are the single
// rank's too (float64 and float32). The meshes include ZeRO stages 1 and 2
// (the kept gathered copies, runtime/parallel/zero.h; the others run
// stage 3) and two LoRA adapters over one shared base, each call sampling
// from its adapter.
//
// GreedyReferenceGoldenTest: float32 greedy decoding equals the independent
// HF-faithful PyTorch model (tests/python/hf_reference.py) computing in
// float32, token for token (float64: runtime/sample/kv_cache_test.cc).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/checkpoint/weights_export.h"
#include "runtime/model/causal_lm.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/engine_groups.h"
#include "runtime/parallel/zero.h"
#include "runtime/sample/decode.h"
#include "runtime/sample/prompt_logprobs.h"
#include "tests/testing/hf_reference.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

namespace fs = std::filesystem;
using testing::RelativeDiff;

// bfloat16: the largest relative distance (max norm, over every token of a
// request) of the mesh's decoded log-probabilities to the float32 training
// forward's, over the single rank's bf16 training forward's distance to the
// same: the decode's cached attention and held weights round differently
// from the training forward, not much more. Measured over the meshes below
// (seeds as here): dense models 0.65 to 1.56, the LoRA adapters up to 2.06,
// the MoE model 2.78 on every MoE mesh alike (the single rank's cached bf16
// path, not the mesh); the bound keeps a margin of 1.4x over the largest.
constexpr double kBf16DecodeFactor = 4.0;

struct DecodeMesh {
  const char* name;
  MeshShape shape;
  bool moe = false;   // the 4-expert Mixtral-style model
  bool lora = false;  // two LoRA adapters (TestLora) over one shared base
  ZeroStage zero = ZeroStage::kParameters;
};

using testing::Shape;

void PrintTo(const DecodeMesh& mesh, std::ostream* os) { *os << mesh.name; }

std::string MeshName(const ::testing::TestParamInfo<DecodeMesh>& info) {
  return info.param.name;
}

// How the engine splits a model over this rank's groups (EngineGroups).
ModelSharding MeshSharding(const EngineGroups& g, ZeroStage zero) {
  ModelSharding sharding;
  sharding.tp = g.tp;
  sharding.dp_shard = g.dp_shard;
  sharding.zero_stage = zero;
  sharding.cp = g.cp;
  sharding.ep = g.ep;
  sharding.pp_stage = g.pp->rank();
  sharding.pp_stages = g.pp->size();
  return sharding;
}

// Draws the parameters of `reference` (all, or only the LoRA factors) from
// `seed`, in float64 whatever the dtype: norms 1 + N(0, 0.1²), the
// embedding N(0, 0.3²), every other matrix (LoRA's B too, so adapters act)
// N(0, 1 / fan_in).
bool Drawn(const Parameter& p, bool lora_only) {
  return !lora_only || absl::StrContains(p.name, ".lora_");
}

void DrawWeights(CausalLm& reference, uint64_t seed, bool lora_only) {
  torch::NoGradGuard no_grad;
  torch::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (Parameter& p : reference.parameters()) {
    if (!Drawn(p, lora_only)) continue;
    torch::Tensor r = torch::randn(p.tensor.sizes(), generator,
                                   torch::TensorOptions(torch::kFloat64));
    if (absl::EndsWith(p.name, "norm.weight")) {
      r = 1 + 0.1 * r;
    } else if (p.name == "model.embed_tokens.weight") {
      r = 0.3 * r;
    } else {
      r = r / std::sqrt(static_cast<double>(p.tensor.size(-1)));
    }
    p.tensor.copy_(r);
  }
}

// DrawWeights on `reference`, and `model` gets its shards of the same values.
void DrawWeights(CausalLm& reference, CausalLm& model, uint64_t seed,
                 bool lora_only) {
  DrawWeights(reference, seed, lora_only);
  torch::NoGradGuard no_grad;
  for (Parameter& p : model.parameters()) {
    if (!Drawn(p, lora_only)) continue;
    p.tensor.copy_(model.LocalShard(p, reference.Find(p.name)->tensor));
  }
}

// The single-rank models and this rank's shards of the same weights, pair
// by pair: one pair, or one per adapter over a shared base.
struct ModelPairs {
  std::vector<std::unique_ptr<CausalLm>> references;
  std::vector<std::unique_ptr<CausalLm>> meshes;
};

absl::StatusOr<ModelPairs> BuildModels(const DecodeMesh& mesh_case,
                                       const LlamaConfig& config, DType dtype,
                                       const EngineGroups& g) {
  const ModelSharding sharding = MeshSharding(g, mesh_case.zero);
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> reference,
                         CreateCausalLm(config, dtype, 7, {}));
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> mesh,
                         CreateCausalLm(config, dtype, 7, sharding));
  DrawWeights(*reference, *mesh, 11, /*lora_only=*/false);
  ModelPairs pairs;
  if (!mesh_case.lora) {
    pairs.references.push_back(std::move(reference));
    pairs.meshes.push_back(std::move(mesh));
  } else {
    reference->FreezeBase();
    mesh->FreezeBase();
    const std::shared_ptr<const CausalLm> reference_base = std::move(reference);
    const std::shared_ptr<const CausalLm> mesh_base = std::move(mesh);
    for (uint64_t adapter : {1, 2}) {
      ModelAdapters adapters;
      adapters.lora = testing::TestLora();
      adapters.base = reference_base;
      TALLY_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> r,
                             CreateCausalLm(config, dtype, 7, {}, adapters));
      adapters.base = mesh_base;
      TALLY_ASSIGN_OR_RETURN(
          std::unique_ptr<CausalLm> m,
          CreateCausalLm(config, dtype, 7, sharding, adapters));
      DrawWeights(*r, *m, 11 + adapter, /*lora_only=*/true);
      pairs.references.push_back(std::move(r));
      pairs.meshes.push_back(std::move(m));
    }
  }
  for (std::unique_ptr<CausalLm>& m : pairs.meshes) {
    if (!m->sharding().keeps_gathered()) continue;
    TALLY_RETURN_IF_ERROR(
        RefreshGatheredCopies(m->parameters(), m->compute_type(), *g.dp_shard,
                              [](const Parameter&) { return true; }));
  }
  return pairs;
}

// Prompts of 5, 2 and 7 tokens.
std::vector<std::vector<int64_t>> Prompts() {
  return {{3, 17, 9, 40, 1}, {22, 5}, {8, 8, 30, 2, 11, 47, 6}};
}

// Whether some sequence of `run` other than the first never draws `token`.
bool AnotherNeverDraws(const std::vector<DecodedSequence>& run, int64_t token) {
  for (size_t i = 1; i < run.size(); ++i) {
    if (std::count(run[i].tokens.begin(), run[i].tokens.end(), token) == 0) {
      return true;
    }
  }
  return false;
}

// The requests each mesh decodes: greedy, then sampling with temperature,
// top-k and top-p, each with a stop token that ends sequence 0 early and
// another sequence not (the first of sequence 0's tokens after its first
// that some other sequence never draws, read off the reference's run
// without it), then one prompt.
absl::StatusOr<std::vector<DecodeRequest>> Requests(CausalLm& reference) {
  DecodeRequest greedy;
  greedy.prompts = Prompts();
  greedy.max_tokens = 6;
  greedy.sampling.temperature = 0;
  DecodeRequest sampled = greedy;
  sampled.sampling = {0.9, 0.95, 20};
  sampled.seed = 1234;
  std::vector<DecodeRequest> requests;
  for (DecodeRequest request : {greedy, sampled}) {
    TALLY_ASSIGN_OR_RETURN(std::vector<DecodedSequence> free_run,
                           Decode(reference, request));
    const std::vector<int64_t>& first = free_run[0].tokens;
    const auto stop = std::find_if(
        first.begin() + 1, first.end(),
        [&](int64_t token) { return AnotherNeverDraws(free_run, token); });
    if (stop == first.end()) {
      return absl::InternalError("no stop token for sequence 0");
    }
    request.stop = {{*stop}};
    requests.push_back(request);
  }
  DecodeRequest single = greedy;
  single.prompts = {{12, 4, 33}};
  single.max_tokens = 4;
  requests.push_back(single);
  return requests;
}

// The same tokens and stop reasons, the same log-probabilities within
// `tolerance`.
void ExpectSameDecode(const std::vector<DecodedSequence>& got,
                      const std::vector<DecodedSequence>& want,
                      double tolerance, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    const std::string where = absl::StrCat(what, ", sequence ", i);
    EXPECT_EQ(got[i].tokens, want[i].tokens) << where;
    EXPECT_EQ(got[i].stop_reason, want[i].stop_reason) << where;
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size()) << where;
    for (size_t t = 0; t < want[i].logprobs.size(); ++t) {
      EXPECT_LE(RelativeDiff(got[i].logprobs[t], want[i].logprobs[t]),
                tolerance)
          << where << ", token " << t;
    }
  }
}

void ExpectSamePromptLogprobs(const std::vector<PromptLogprobs>& got,
                              const std::vector<PromptLogprobs>& want,
                              double tolerance, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    const std::string where = absl::StrCat(what, ", prompt ", i);
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size()) << where;
    ASSERT_EQ(got[i].topk.size(), want[i].topk.size()) << where;
    for (size_t t = 0; t < want[i].logprobs.size(); ++t) {
      EXPECT_LE(RelativeDiff(got[i].logprobs[t], want[i].logprobs[t]),
                tolerance)
          << where << ", position " << t;
      EXPECT_EQ(got[i].topk[t].tokens, want[i].topk[t].tokens)
          << where << ", position " << t;
      for (size_t k = 0; k < want[i].topk[t].logprobs.size(); ++k) {
        EXPECT_LE(RelativeDiff(got[i].topk[t].logprobs[k],
                               want[i].topk[t].logprobs[k]),
                  tolerance)
            << where << ", position " << t << ", top " << k;
      }
    }
  }
}

// bfloat16 greedy tokens: the mesh and the single rank round differently,
// so a choice whose two most likely tokens the single rank puts close
// together may go either way. Close: within 4x the largest difference of
// the two sides' log-probabilities where they chose from the same context
// (the tokens before agree), a gap moving by the change of two
// log-probabilities, with a margin of 2x. Up to each sequence's first such
// choice the tokens must be the same; a sequence without one must be the
// same whole, with its stop reason. Returns how many of the single rank's
// tokens came before a near tie (were compared).
absl::StatusOr<size_t> ExpectSameGreedyBeforeANearTie(
    CausalLm& reference, const std::vector<std::vector<int64_t>>& prompts,
    const std::vector<DecodedSequence>& got,
    const std::vector<DecodedSequence>& want, const std::string& what) {
  double observed = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    for (size_t t = 0;
         t < std::min(got[i].tokens.size(), want[i].tokens.size()) &&
         (t == 0 || got[i].tokens[t - 1] == want[i].tokens[t - 1]);
         ++t) {
      observed = std::max(observed,
                          std::abs(got[i].logprobs[t] - want[i].logprobs[t]));
    }
  }
  const double margin = 4 * observed;
  std::vector<std::vector<int64_t>> completed;
  for (size_t i = 0; i < want.size(); ++i) {
    completed.push_back(prompts[i]);
    completed.back().insert(completed.back().end(), want[i].tokens.begin(),
                            want[i].tokens.end());
  }
  TALLY_ASSIGN_OR_RETURN(std::vector<PromptLogprobs> top2,
                         ComputePromptLogprobs(reference, completed, 2));
  size_t compared = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const std::vector<int64_t>& w = want[i].tokens;
    const std::vector<int64_t>& g = got[i].tokens;
    size_t clear = 0;  // the choices before the first near tie
    for (; clear < w.size(); ++clear) {
      const TopkLogprobs& t = top2[i].topk[prompts[i].size() + clear - 1];
      if (t.logprobs[0] - t.logprobs[1] < margin) break;
    }
    const std::string where = absl::StrCat(what, ", sequence ", i);
    EXPECT_EQ(
        std::vector<int64_t>(g.begin(), g.begin() + std::min(clear, g.size())),
        std::vector<int64_t>(w.begin(), w.begin() + clear))
        << where << ": the first " << clear << " tokens";
    if (clear == w.size()) {
      EXPECT_EQ(g, w) << where;
      EXPECT_EQ(got[i].stop_reason, want[i].stop_reason) << where;
    }
    compared += clear;
  }
  return compared;
}

// The decoded log-probabilities of `decoded`, every sequence's in order, as
// one float64 tensor.
torch::Tensor DecodedLogprobs(const std::vector<DecodedSequence>& decoded) {
  std::vector<double> all;
  for (const DecodedSequence& s : decoded) {
    all.insert(all.end(), s.logprobs.begin(), s.logprobs.end());
  }
  return torch::tensor(all, torch::kFloat64);
}

// The training forward's log-probability of every decoded token given its
// prompt and the tokens before it (one right-padded batch through
// TargetLogprobs), in DecodedLogprobs' order.
torch::Tensor TrainingLogprobs(CausalLm& model,
                               const std::vector<std::vector<int64_t>>& prompts,
                               const std::vector<DecodedSequence>& decoded) {
  torch::NoGradGuard no_grad;
  const auto int64 = torch::TensorOptions().dtype(torch::kInt64);
  std::vector<std::vector<int64_t>> sequences;
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < decoded.size(); ++i) {
    sequences.push_back(prompts[i]);
    sequences.back().insert(sequences.back().end(), decoded[i].tokens.begin(),
                            decoded[i].tokens.end());
    lengths.push_back(static_cast<int64_t>(sequences.back().size()));
  }
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  const int64_t batch = static_cast<int64_t>(sequences.size());
  torch::Tensor inputs = torch::zeros({batch, longest}, int64);
  torch::Tensor targets = torch::zeros({batch, longest}, int64);
  for (int64_t b = 0; b < batch; ++b) {
    const torch::Tensor s = torch::tensor(sequences[b], int64);
    inputs[b].narrow(0, 0, lengths[b]).copy_(s);
    targets[b]
        .narrow(0, 0, lengths[b] - 1)
        .copy_(s.narrow(0, 1, lengths[b] - 1));
  }
  const torch::Tensor logprobs = model.TargetLogprobs(
      inputs, targets, AttentionLayout::RightPadded(lengths, longest));
  std::vector<torch::Tensor> picked;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t prompt = static_cast<int64_t>(prompts[b].size());
    const int64_t n = static_cast<int64_t>(decoded[b].tokens.size());
    picked.push_back(logprobs[b].narrow(0, prompt - 1, n));
  }
  return torch::cat(picked).to(torch::kFloat64);
}

// What one dtype's checks of one model pair need besides the pair: the
// float32 reference of the same weights, for the bf16 bound.
struct DtypeChecks {
  DType dtype;
  CausalLm* float32_reference = nullptr;  // set for kBFloat16
};

// Decodes `requests` on the mesh and on the single rank and checks the
// tokens, the log-probabilities against the training forward and the
// prompts' log-probabilities (float64 and float32).
absl::Status CheckPair(CausalLm& reference, CausalLm& mesh,
                       const DtypeChecks& checks, const DecodeGroups& groups,
                       const std::string& what) {
  const bool bf16 = checks.dtype == DType::kBFloat16;
  const double tolerance = testing::GoldenTolerance(checks.dtype);
  TALLY_ASSIGN_OR_RETURN(std::vector<DecodeRequest> requests,
                         Requests(reference));
  for (size_t r = 0; r < requests.size(); ++r) {
    const std::string where = absl::StrCat(what, ", request ", r);
    TALLY_ASSIGN_OR_RETURN(std::vector<DecodedSequence> want,
                           Decode(reference, requests[r]));
    if (r < 2) {
      // The sequences finish unevenly: 0 stops early, another runs to
      // max_tokens.
      EXPECT_EQ(want[0].stop_reason, StopReason::kStop) << where;
      EXPECT_LT(want[0].tokens.size(), 6u) << where;
      EXPECT_TRUE(want[1].tokens.size() == 6 || want[2].tokens.size() == 6)
          << where;
    }
    TALLY_ASSIGN_OR_RETURN(std::vector<DecodedSequence> got,
                           Decode(mesh, requests[r], groups));
    const torch::Tensor decoded = DecodedLogprobs(got);
    const torch::Tensor trained =
        TrainingLogprobs(reference, requests[r].prompts, got);
    if (!bf16) {
      ExpectSameDecode(got, want, tolerance, where);
      EXPECT_LE(RelativeDiff(decoded, trained), tolerance) << where;
      continue;
    }
    const torch::Tensor float32 =
        TrainingLogprobs(*checks.float32_reference, requests[r].prompts, got);
    const double decode_distance = RelativeDiff(decoded, float32);
    const double training_distance = RelativeDiff(trained, float32);
    EXPECT_LE(decode_distance, kBf16DecodeFactor * training_distance)
        << where << ": the bf16 decode's distance to float32 is "
        << decode_distance / training_distance
        << " times the bf16 training forward's";
    // The bound is no bound at all if bf16 were exact here.
    EXPECT_GT(training_distance, 1e-4) << where;
    if (requests[r].sampling.temperature == 0) {
      TALLY_ASSIGN_OR_RETURN(
          const size_t compared,
          ExpectSameGreedyBeforeANearTie(reference, requests[r].prompts, got,
                                         want, where));
      // The margin leaves tokens to check (measured: 3 or 4 of the 11 to
      // 14 of request 0, where the near ties come early; more than half of
      // the others').
      EXPECT_GT(compared, 0u)
          << where << ": " << compared << " tokens before a near tie";
    }
  }
  if (bf16) return absl::OkStatus();
  TALLY_ASSIGN_OR_RETURN(
      std::vector<PromptLogprobs> want_prompts,
      ComputePromptLogprobs(reference, Prompts(), /*topk=*/3));
  TALLY_ASSIGN_OR_RETURN(
      std::vector<PromptLogprobs> got_prompts,
      ComputePromptLogprobs(mesh, Prompts(), /*topk=*/3, groups));
  ExpectSamePromptLogprobs(got_prompts, want_prompts, tolerance, what);
  return absl::OkStatus();
}

class DecodeGoldenTest : public ::testing::TestWithParam<DecodeMesh> {};

TEST_P(DecodeGoldenTest, EqualsTheSingleRank) {
  const DecodeMesh& mesh_case = GetParam();
  const LlamaConfig config =
      mesh_case.moe ? testing::MoeConfig() : testing::TinyConfig();
  testing::RunOnRanks(
      mesh_case.shape.world_size(), [&](const RankEnv& env) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(Mesh mesh,
                               Mesh::Create(mesh_case.shape, env.rank));
        TALLY_ASSIGN_OR_RETURN(
            std::unique_ptr<ProcessGroups> process_groups,
            ProcessGroups::Create(env, mesh, absl::Seconds(60),
                                  absl::Seconds(60)));
        TALLY_ASSIGN_OR_RETURN(EngineGroups g,
                               FormEngineGroups(*process_groups));
        // As Engine::Sample passes them: the world agrees every few steps
        // whether to stop, whichever ranks still decode.
        const DecodeGroups groups{g.data_and_cp, g.pp, g.world};
        // float32 before bfloat16, whose bound reads the float32 models.
        ModelPairs float32;
        for (DType dtype :
             {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
          TALLY_ASSIGN_OR_RETURN(ModelPairs pairs,
                                 BuildModels(mesh_case, config, dtype, g));
          for (size_t m = 0; m < pairs.meshes.size(); ++m) {
            DtypeChecks checks{dtype};
            if (dtype == DType::kBFloat16) {
              checks.float32_reference = float32.references[m].get();
            }
            TALLY_RETURN_IF_ERROR(CheckPair(
                *pairs.references[m], *pairs.meshes[m], checks, groups,
                absl::StrCat(DTypeName(dtype), ", model ", m, ", rank ",
                             env.rank)));
          }
          if (dtype == DType::kFloat32) float32 = std::move(pairs);
        }
        return absl::OkStatus();
      });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, DecodeGoldenTest,
    ::testing::Values(
        DecodeMesh{"dp_replicate2", Shape(2, 1, 1)},
        DecodeMesh{"dp_shard2", Shape(1, 2, 1)},
        DecodeMesh{"zero1_dp_shard2", Shape(1, 2, 1), /*moe=*/false,
                   /*lora=*/false, ZeroStage::kOptimizerState},
        DecodeMesh{"zero2_dp_shard2_tp2", Shape(1, 2, 2), /*moe=*/false,
                   /*lora=*/false, ZeroStage::kGradients},
        DecodeMesh{"tp2", Shape(1, 1, 2)}, DecodeMesh{"cp2", Shape(1, 1, 1, 2)},
        DecodeMesh{"ep2", Shape(1, 2, 1, 1, 2), /*moe=*/true},
        DecodeMesh{"cp2_ep2", Shape(1, 1, 1, 2, 2), /*moe=*/true},
        DecodeMesh{"pp2", Shape(1, 1, 1, 1, 1, 2)},
        DecodeMesh{"pp2_dp_shard2", Shape(1, 2, 1, 1, 1, 2)},
        DecodeMesh{"dp_shard2_tp2_ep2", Shape(1, 2, 2, 1, 2), /*moe=*/true},
        DecodeMesh{"dp_shard2_tp2_lora", Shape(1, 2, 2), /*moe=*/false,
                   /*lora=*/true}),
    MeshName);

// Float32 greedy decoding on one rank (which every mesh above equals, token
// for token) against the reference reading the model's float32 weights
// export and computing in float32: the same tokens, log-probabilities
// within GoldenTolerance (two float32 computations in different orders).
TEST(GreedyReferenceGoldenTest, Float32EqualsTheReferenceTokenForToken) {
  if (!testing::ReferencePythonAvailable()) {
    GTEST_SKIP() << "python3 is not installed";
  }
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "mixtral" : "llama");
    const LlamaConfig config =
        moe ? testing::MoeConfig() : testing::TinyConfig();
    std::unique_ptr<CausalLm> model =
        CreateCausalLm(config, DType::kFloat32, 7, {}).value();
    DrawWeights(*model, 11, /*lora_only=*/false);
    std::string dir =
        (fs::path(::testing::TempDir()) / "decode_golden_XXXXXX").string();
    ASSERT_NE(mkdtemp(dir.data()), nullptr);
    ASSERT_TRUE(WriteWeightsExport(dir + "/model", *model, {}, "").ok());
    DecodeRequest request;
    request.prompts = Prompts();
    request.max_tokens = 12;
    request.sampling.temperature = 0;
    const std::vector<DecodedSequence> decoded =
        Decode(*model, request).value();
    const absl::StatusOr<std::vector<testing::ReferenceDecode>> reference =
        testing::ReferenceGreedy(dir + "/model", request.prompts,
                                 request.max_tokens, "float32");
    fs::remove_all(dir);
    ASSERT_TRUE(reference.ok()) << reference.status();
    ASSERT_EQ(reference->size(), decoded.size());
    for (size_t i = 0; i < decoded.size(); ++i) {
      EXPECT_EQ(decoded[i].tokens, (*reference)[i].tokens) << "prompt " << i;
      ASSERT_EQ(decoded[i].logprobs.size(), (*reference)[i].logprobs.size());
      EXPECT_LE(RelativeDiff(
                    DecodedLogprobs({decoded[i]}),
                    torch::tensor((*reference)[i].logprobs, torch::kFloat64)),
                testing::GoldenTolerance(DType::kFloat32))
          << "prompt " << i;
    }
  }
}

}  // namespace
}  // namespace tally
