// Golden tests of decoding on a mesh (runtime/sample/mesh_decode.h): real
// rank processes on loopback, each decoding with its shard of a float64 model
// (with LoRA adapters on one mesh)
// and, in the same process, with the single-rank model of the same seed.
// Every rank must return the whole result of the single rank: the same
// tokens and stop reasons, log-probabilities within 1e-10 relative, for
// greedy and seeded sampling, prompts of different lengths of which one
// stops early (the ranks of a lockstep group finish unevenly), and a
// one-prompt call that leaves every data rank but one without a sequence;
// and the prompts' log-probabilities with their top 3 (prompt_logprobs.h).
#include <gtest/gtest.h>

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/model/causal_lm.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/engine_groups.h"
#include "runtime/sample/decode.h"
#include "runtime/sample/prompt_logprobs.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::RelativeDiff;

struct DecodeMesh {
  const char* name;
  MeshShape shape;
  bool moe = false;   // the 4-expert Mixtral-style model
  bool lora = false;  // LoRA adapters on every projection (TestLora)
};

using testing::Shape;

void PrintTo(const DecodeMesh& mesh, std::ostream* os) { *os << mesh.name; }

std::string MeshName(const ::testing::TestParamInfo<DecodeMesh>& info) {
  return info.param.name;
}

// This rank's model of `config` split over its groups as the engine splits
// it (ModelSharding from EngineGroups), float64, seed 7.
absl::StatusOr<std::unique_ptr<CausalLm>> RankModel(
    const LlamaConfig& config, const ModelAdapters& adapters,
    const EngineGroups& g) {
  ModelSharding sharding;
  sharding.tp = g.tp;
  sharding.dp_shard = g.dp_shard;
  sharding.cp = g.cp;
  sharding.ep = g.ep;
  sharding.pp_stage = g.pp->rank();
  sharding.pp_stages = g.pp->size();
  return CreateCausalLm(config, DType::kFloat64, 7, sharding, adapters);
}

// LoRA's B factors start at zero (the adapters would do nothing): draws
// them in `reference` (normal, std 0.3) and gives `model` its shards of the
// same values.
void ActivateAdapters(CausalLm& reference, CausalLm& model) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  for (Parameter& p : reference.parameters()) {
    if (p.name.find(".lora_B.") != std::string::npos) {
      p.tensor.copy_(0.3 * torch::randn_like(p.tensor));
    }
  }
  for (Parameter& p : model.parameters()) {
    if (p.name.find(".lora_B.") != std::string::npos) {
      p.tensor.copy_(model.LocalShard(p, reference.Find(p.name)->tensor));
    }
  }
}

// Prompts of 5, 2 and 7 tokens.
std::vector<std::vector<int64_t>> Prompts() {
  return {{3, 17, 9, 40, 1}, {22, 5}, {8, 8, 30, 2, 11, 47, 6}};
}

// The requests each mesh decodes: greedy, then sampling with temperature,
// top-k and top-p, each with a stop token that ends sequence 0 after its
// second token (read off the reference's run without it), then one prompt.
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
    request.stop = {{free_run[0].tokens[1]}};
    requests.push_back(request);
  }
  DecodeRequest single = greedy;
  single.prompts = {{12, 4, 33}};
  single.max_tokens = 4;
  requests.push_back(single);
  return requests;
}

void ExpectSameDecode(const std::vector<DecodedSequence>& got,
                      const std::vector<DecodedSequence>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    const std::string where = absl::StrCat(what, ", sequence ", i);
    EXPECT_EQ(got[i].tokens, want[i].tokens) << where;
    EXPECT_EQ(got[i].stop_reason, want[i].stop_reason) << where;
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size()) << where;
    for (size_t t = 0; t < want[i].logprobs.size(); ++t) {
      EXPECT_LE(RelativeDiff(got[i].logprobs[t], want[i].logprobs[t]), 1e-10)
          << where << ", token " << t;
    }
  }
}

void ExpectSamePromptLogprobs(const std::vector<PromptLogprobs>& got,
                              const std::vector<PromptLogprobs>& want,
                              const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    const std::string where = absl::StrCat(what, ", prompt ", i);
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size()) << where;
    ASSERT_EQ(got[i].topk.size(), want[i].topk.size()) << where;
    for (size_t t = 0; t < want[i].logprobs.size(); ++t) {
      EXPECT_LE(RelativeDiff(got[i].logprobs[t], want[i].logprobs[t]), 1e-10)
          << where << ", position " << t;
      EXPECT_EQ(got[i].topk[t].tokens, want[i].topk[t].tokens)
          << where << ", position " << t;
      for (size_t k = 0; k < want[i].topk[t].logprobs.size(); ++k) {
        EXPECT_LE(RelativeDiff(got[i].topk[t].logprobs[k],
                               want[i].topk[t].logprobs[k]),
                  1e-10)
            << where << ", position " << t << ", top " << k;
      }
    }
  }
}

class DecodeGoldenTest : public ::testing::TestWithParam<DecodeMesh> {};

TEST_P(DecodeGoldenTest, EqualsTheSingleRank) {
  const DecodeMesh& mesh_case = GetParam();
  const LlamaConfig config =
      mesh_case.moe ? testing::MoeConfig() : testing::TinyConfig();
  ModelAdapters adapters;
  if (mesh_case.lora) adapters.lora = testing::TestLora();
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
        TALLY_ASSIGN_OR_RETURN(std::unique_ptr<CausalLm> model,
                               RankModel(config, adapters, g));
        TALLY_ASSIGN_OR_RETURN(
            std::unique_ptr<CausalLm> reference,
            CreateCausalLm(config, DType::kFloat64, 7, {}, adapters));
        if (mesh_case.lora) ActivateAdapters(*reference, *model);
        TALLY_ASSIGN_OR_RETURN(std::vector<DecodeRequest> requests,
                               Requests(*reference));
        // As Engine::Sample passes them: the world agrees every few steps
        // whether to stop, whichever ranks still decode.
        const DecodeGroups groups{g.data_and_cp, g.pp, g.world};
        for (size_t r = 0; r < requests.size(); ++r) {
          TALLY_ASSIGN_OR_RETURN(std::vector<DecodedSequence> want,
                                 Decode(*reference, requests[r]));
          if (r < 2) {
            // The sequences finish unevenly: 0 stops early, another runs
            // to max_tokens.
            EXPECT_EQ(want[0].stop_reason, StopReason::kStop);
            EXPECT_EQ(want[0].tokens.size(), 2u);
            EXPECT_TRUE(want[1].tokens.size() == 6 ||
                        want[2].tokens.size() == 6);
          }
          TALLY_ASSIGN_OR_RETURN(std::vector<DecodedSequence> got,
                                 Decode(*model, requests[r], groups));
          ExpectSameDecode(got, want,
                           absl::StrCat("request ", r, " on rank ", env.rank));
        }
        TALLY_ASSIGN_OR_RETURN(
            std::vector<PromptLogprobs> want_prompts,
            ComputePromptLogprobs(*reference, Prompts(), /*topk=*/3));
        TALLY_ASSIGN_OR_RETURN(
            std::vector<PromptLogprobs> got_prompts,
            ComputePromptLogprobs(*model, Prompts(), /*topk=*/3, groups));
        ExpectSamePromptLogprobs(got_prompts, want_prompts,
                                 absl::StrCat("rank ", env.rank));
        return absl::OkStatus();
      });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, DecodeGoldenTest,
    ::testing::Values(DecodeMesh{"dp_replicate2", Shape(2, 1, 1)},
                      DecodeMesh{"dp_shard2", Shape(1, 2, 1)},
                      DecodeMesh{"tp2", Shape(1, 1, 2)},
                      DecodeMesh{"cp2", Shape(1, 1, 1, 2)},
                      DecodeMesh{"ep2", Shape(1, 2, 1, 1, 2), /*moe=*/true},
                      DecodeMesh{"cp2_ep2", Shape(1, 1, 1, 2, 2),
                                 /*moe=*/true},
                      DecodeMesh{"pp2", Shape(1, 1, 1, 1, 1, 2)},
                      DecodeMesh{"pp2_dp_shard2", Shape(1, 2, 1, 1, 1, 2)},
                      DecodeMesh{"dp_shard2_tp2_ep2", Shape(1, 2, 2, 1, 2),
                                 /*moe=*/true},
                      DecodeMesh{"dp_shard2_tp2_lora", Shape(1, 2, 2),
                                 /*moe=*/false, /*lora=*/true}),
    MeshName);

}  // namespace
}  // namespace tally
