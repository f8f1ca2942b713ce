// ShardingPlan: how a model family's parameters are split over the mesh, as
// data — one rule per parameter name pattern, in the spirit of torchtitan's
// parallelize plans (ColwiseParallel, RowwiseParallel, ...) — apart from the
// model code that uses them. A family writes its plan once; PlaceParameter
// turns a rule into Placements, and LocalShardOf / GatherFullOf move a
// tensor between its full shape and this rank's shard for any placement.
//
//   tally::ShardingPlan plan;
//   plan.rules = {{"model.layers.*.self_attn.q_proj.weight",
//                  tally::ParallelStyle::kColumnwise},
//                 {"model.layers.*.input_layernorm.weight",
//                  tally::ParallelStyle::kReplicate}};
//   TALLY_ASSIGN_OR_RETURN(const tally::PlanRule* rule, plan.RuleFor(name));
//   tally::Parameter p = tally::PlaceParameter(name, shape, *rule, sharding);
//   torch::Tensor local = tally::LocalShardOf(p, full, sharding);
#ifndef TALLY_RUNTIME_PARALLEL_SHARDING_PLAN_H_
#define TALLY_RUNTIME_PARALLEL_SHARDING_PLAN_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/config/types.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/parameter.h"

namespace tally {

// The groups a model is split over. A null or single-rank group means the
// dimension is not split; the default is the single-device model.
struct ModelSharding {
  Communicator* tp = nullptr;  // Megatron tensor parallelism
  // ZeRO parameter sharding (FSDP at zero_stage 3). Whatever the stage, a
  // parameter's placement and local shard are the same: stages 1 and 2 keep
  // a gathered copy besides (Parameter::gathered).
  Communicator* dp_shard = nullptr;
  ZeroStage zero_stage = ZeroStage::kParameters;
  // Context parallelism: the ranks splitting each sample's tokens, whose
  // keys and values attention gathers. Parameters are replicated over it.
  Communicator* cp = nullptr;
  // Expert parallelism: the ranks splitting the experts of every MoE layer,
  // each computing its experts for the tokens of all of them.
  Communicator* ep = nullptr;
  // Pipeline parallelism: this rank builds and runs stage `pp_stage` of
  // `pp_stages` (see pipeline.h). The engine moves activations between
  // stages; the model itself never talks to another stage.
  int pp_stage = 0;
  int pp_stages = 1;

  int ep_size() const { return ep ? ep->size() : 1; }
  int ep_rank() const { return ep ? ep->rank() : 0; }
  int tp_size() const { return tp ? tp->size() : 1; }
  int tp_rank() const { return tp ? tp->rank() : 0; }
  int dp_shard_size() const { return dp_shard ? dp_shard->size() : 1; }
  int dp_shard_rank() const { return dp_shard ? dp_shard->rank() : 0; }
  // ZeRO stages 1 and 2 over a real dp_shard group: the parameters split
  // over it keep a gathered copy (Parameter::gathered).
  bool keeps_gathered() const {
    return dp_shard_size() > 1 && zero_stage != ZeroStage::kParameters;
  }
  int cp_size() const { return cp ? cp->size() : 1; }
};

// How one parameter meets tensor and expert parallelism. Every style but
// kExpert is also dim-0 sharded over dp_shard (ZeRO-3) and replicated over
// dp_replicate and cp.
enum class ParallelStyle {
  kReplicate,   // the same on every tp rank (norms, a MoE router)
  kColumnwise,  // tp Shard(0): output features (q, k, v, gate, up, and the
                // vocabulary rows of embedding and lm_head)
  kRowwise,     // tp Shard(1): input features (o, down)
  kExpert,      // stacked experts [E, ...]: ep Shard(0), replicated over tp
                // and dp_shard
};

struct PlanRule {
  // A parameter name where each '*' stands for one name component's digits
  // (a layer number): "model.layers.*.mlp.up_proj.weight".
  std::string pattern;
  ParallelStyle style = ParallelStyle::kReplicate;
  // Held by more than one pipeline stage as one parameter (a tied
  // embedding): Replicate over pp, counted once by the norm (on stage 0).
  // Otherwise Shard over pp: each stage holds its own parameters.
  bool shared_across_stages = false;
};

// Whether `name` matches `pattern`, where each '*' stands for one name
// component's digits (a layer number).
bool NameMatches(const std::string& pattern, const std::string& name);

struct ShardingPlan {
  std::vector<PlanRule> rules;
  // The first rule whose pattern matches `name`; INTERNAL naming it when
  // none does (a family's plan must cover all its parameters).
  absl::StatusOr<const PlanRule*> RuleFor(const std::string& name) const;
};

// A parameter a family declares: its HF name and full shape, how it is
// initialized, and whether this pipeline stage holds it.
// How CausalLm::InitializeParameters fills a parameter (as HF's
// _init_weights: matrices normal(0, initializer_range 0.02), norm weights
// ones, biases zeros; a LoRA A matrix as PEFT's, Kaiming-uniform with
// a = sqrt(5): uniform in +-1/sqrt(in_features)).
enum class ParameterInit { kNormal, kOnes, kZeros, kKaimingUniform };

struct ParameterSpec {
  std::string name;
  std::vector<int64_t> shape;
  ParameterInit init = ParameterInit::kNormal;
  bool held = true;
};

// The Parameter `rule` makes of `name` (no tensor yet): placements,
// full_shape and tp_local_shape under `sharding`.
Parameter PlaceParameter(const std::string& name,
                         const std::vector<int64_t>& shape,
                         const PlanRule& rule, const ModelSharding& sharding);

// This rank's shard of `full` (shaped like p.full_shape), a fresh tensor.
torch::Tensor LocalShardOf(const Parameter& p, const torch::Tensor& full,
                           const ModelSharding& sharding);
// The inverse: the full tensor from every rank's `local` (shaped like
// p.tensor). Collective over the groups p is split over.
absl::StatusOr<torch::Tensor> GatherFullOf(const Parameter& p,
                                           const torch::Tensor& local,
                                           const ModelSharding& sharding);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_SHARDING_PLAN_H_
