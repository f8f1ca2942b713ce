// The mixture-of-experts MLP block, HF Mixtral semantics: a softmax router,
// each token's top-k experts renormalized over the chosen k, SwiGLU experts
// w2(silu(w1 x) * w3 x). A family with MoE layers (Mixtral today) calls
// SparseMoeForward where a dense model calls its MLP.
//
// The experts of a layer are held as three stacked parameters
// "...experts.{w1,w2,w3}.weight" [E, ...], Shard(0) over ep; ExpertWeightsToHf
// / ExpertWeightsFromHf map them to and from HF's per-expert names
// "...experts.{e}.w1.weight" at the checkpoint boundary. Under ep every rank
// computes its experts for the tokens of the whole ep group (a dispatch
// all-gather and a combine reduce-scatter).
//
//   tally::MoeWeights w{router, w1, w2, w3};
//   torch::Tensor out = tally::SparseMoeForward(options, h, w, ep_rows,
//                                               sharding, &io);
#ifndef TALLY_RUNTIME_MODEL_MOE_BLOCK_H_
#define TALLY_RUNTIME_MODEL_MOE_BLOCK_H_

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/causal_lm.h"
#include "runtime/parallel/sharding_plan.h"

namespace tally {

// The name of the load-balancing term among a model's auxiliary losses.
inline constexpr char kRouterLoadBalancing[] = "router_load_balancing";

struct MoeOptions {
  int64_t num_experts = 0;
  int64_t experts_per_token = 2;
  // This block's layer among the model's `num_layers` (the row it fills in
  // StageIo::expert_tokens).
  int64_t layer = 0;
  int64_t num_layers = 1;
};

// The channels of the load-balancing loss in StageIo::auxiliary: per token,
// its router probabilities summed over the MoE layers so far (E channels,
// differentiable) and how many of those layers chose each expert among the
// token's top k (E channels, constants).
int64_t LoadBalancingChannels(int64_t num_experts);

// The tp-local (dp_shard-gathered) weights of one MoE block.
struct MoeWeights {
  torch::Tensor router;      // [E, H]
  torch::Tensor w1, w2, w3;  // [E/ep, I, H], [E/ep, H, I], [E/ep, I, H]
};

// INVALID_ARGUMENT when ep does not divide config.num_local_experts of a MoE
// config (a dense model ignores ep).
absl::Status ValidateExpertParallel(const LlamaConfig& config, int ep);

// The rows each ep rank's tokens are padded to for the dispatch: the most
// tokens any rank of the ep group has in this call (collective over ep).
int64_t ExpertDispatchRows(int64_t tokens, const ModelSharding& sharding);

// The block on h [B, T, H]. With `io`, adds the block's router
// probabilities and top-k choices to the load-balancing channels
// io->auxiliary[0] [B, T, 2E] and counts the real tokens routed to each
// expert into row `layer` of io->expert_tokens.
torch::Tensor SparseMoeForward(const MoeOptions& options,
                               const torch::Tensor& h, const MoeWeights& w,
                               int64_t ep_rows, const ModelSharding& sharding,
                               StageIo* io);

// HF's load_balancing_loss_func per sample, as a per-token term [B, T]:
// every token of sample (row) b carries its sample's
//   aux_b = E * sum_e (C_be / N_b) * (P_be / N_b),
// where over the sample's real tokens and all `num_layers` MoE layers
// (N_b = tokens * num_layers token-layer pairs) C_be counts the pairs whose
// top k holds expert e and P_be sums their router probability of e —
// exactly HF's term for a batch of that one sequence. Joining each token's
// loss, aux_b is weighted and normalized like the main loss, so a window's
// term does not depend on how its samples are split into calls, micro-
// batches or ranks. `channels` are io->auxiliary[0] after the last layer;
// under context parallelism a row holds the rank's block of the sample, and
// the sums run over the cp group (differentiably).
torch::Tensor LoadBalancingLoss(const torch::Tensor& channels,
                                const torch::Tensor& real_tokens,
                                int64_t num_layers, Communicator* cp);

// The stacked expert parameter "....experts.w1.weight" [E, ...] a per-expert
// HF name "....experts.{e}.w1.weight" belongs to, and e; nullopt for any
// other name.
std::optional<std::pair<std::string, int64_t>> StackedExpertName(
    const std::string& hf_name);
// Replaces every stacked expert tensor of `tensors` by its E per-expert HF
// tensors (the order of the other tensors is kept).
NamedTensors ExpertWeightsToHf(NamedTensors tensors);
// The inverse: per-expert HF tensors stacked under the stacked name (experts
// in index order). INVALID_ARGUMENT when an expert index is missing,
// repeated, or the experts' shapes differ.
absl::StatusOr<NamedTensors> ExpertWeightsFromHf(NamedTensors tensors);

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_MOE_BLOCK_H_
