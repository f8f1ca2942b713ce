#include "runtime/model/moe_block.h"

#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "runtime/parallel/parallel_ops.h"

namespace tally {

absl::Status ValidateExpertParallel(const LlamaConfig& config, int ep) {
  // A dense model has nothing to split: it runs on an ep mesh unchanged.
  if (!config.is_moe()) return absl::OkStatus();
  if (config.num_local_experts % ep != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.num_local_experts (", config.num_local_experts,
                     ") is not divisible by ep (", ep, ")"));
  }
  return absl::OkStatus();
}

int64_t ExpertDispatchRows(int64_t tokens, const ModelSharding& sharding) {
  if (sharding.ep_size() == 1) return tokens;
  torch::Tensor rows =
      torch::tensor({static_cast<double>(tokens)}, torch::kFloat64);
  const absl::Status reduced = sharding.ep->AllReduce(rows, ReduceOp::kMax);
  TORCH_CHECK(reduced.ok(),
              "ep token count all_reduce: ", std::string(reduced.message()));
  return static_cast<int64_t>(rows.item<double>());
}

int64_t LoadBalancingChannels(int64_t num_experts) { return 2 * num_experts; }

namespace {

// Counts the real tokens routed to each expert and adds the block's router
// probabilities and choices to the load-balancing channels.
void RecordRouting(const MoeOptions& options, const torch::Tensor& h,
                   const torch::Tensor& probs, const torch::Tensor& top_experts,
                   StageIo& io) {
  const int64_t tokens = top_experts.size(0), experts = options.num_experts;
  const torch::Tensor real = io.real_tokens.reshape({tokens});
  io.expert_tokens[options.layer].index_add_(
      0, top_experts.masked_select(real.unsqueeze(1)),
      torch::ones({real.sum().item<int64_t>() * top_experts.size(1)},
                  io.expert_tokens.options()));
  torch::Tensor chosen = torch::zeros_like(probs).scatter_add(
      1, top_experts, torch::ones(top_experts.sizes(), probs.options()));
  torch::Tensor channels =
      torch::cat({probs, chosen}, 1)
          .view({h.size(0), h.size(1), LoadBalancingChannels(experts)});
  if (io.auxiliary.empty()) io.auxiliary.emplace_back();
  torch::Tensor& sum = io.auxiliary[0];
  sum = sum.defined() ? sum + channels : channels;
}

}  // namespace

torch::Tensor LoadBalancingLoss(const torch::Tensor& channels,
                                const torch::Tensor& real_tokens,
                                int64_t num_layers, Communicator* cp) {
  const int64_t experts = channels.size(-1) / 2;
  const torch::Tensor real = real_tokens.to(channels.scalar_type());
  // Per sample [B, E]: the sums over its real tokens.
  torch::Tensor probs =
      (channels.narrow(-1, 0, experts) * real.unsqueeze(-1)).sum(1);
  torch::Tensor chosen =
      (channels.narrow(-1, experts, experts).detach() * real.unsqueeze(-1))
          .sum(1);
  torch::Tensor tokens = real.sum(1);  // [B]
  if (cp != nullptr && cp->size() > 1) {
    // Forward and backward all-reduce: every cp rank's tokens feed the
    // sample's sums, and every rank's share of the loss reaches them all.
    probs = ReduceFromTensorParallelRegion(
        CopyToTensorParallelRegion(probs, *cp), *cp);
    torch::Tensor counts = torch::cat({chosen, tokens.unsqueeze(1)}, 1);
    const absl::Status reduced = cp->AllReduce(counts, ReduceOp::kSum);
    TORCH_CHECK(reduced.ok(), "load-balancing all_reduce over cp: ",
                std::string(reduced.message()));
    chosen = counts.narrow(1, 0, experts);
    tokens = counts.select(1, experts);
  }
  const torch::Tensor pairs = (tokens * num_layers).clamp_min(1).unsqueeze(1);
  torch::Tensor aux = static_cast<double>(experts) *
                      ((chosen / pairs) * (probs / pairs)).sum(1);  // [B]
  return aux.unsqueeze(1).expand({channels.size(0), channels.size(1)});
}

torch::Tensor SparseMoeForward(const MoeOptions& options,
                               const torch::Tensor& h, const MoeWeights& w,
                               int64_t ep_rows, const ModelSharding& sharding,
                               StageIo* io) {
  const int64_t hidden = h.size(-1), tokens = h.numel() / hidden;
  const int64_t experts = options.num_experts;
  // Replicated over tp: every tp rank computes the whole layer, so it needs
  // no tp region (the residual stream is identical on the tp ranks).
  torch::Tensor x = h.reshape({tokens, hidden});
  torch::Tensor probs = torch::softmax(torch::linear(x, w.router), -1);
  auto [top_probs, top_experts] =
      probs.topk(options.experts_per_token, /*dim=*/-1);
  if (io != nullptr) RecordRouting(options, h, probs, top_experts, *io);
  top_probs = top_probs / top_probs.sum(-1, /*keepdim=*/true);
  // combine[n, e]: token n's weight for expert e, zero outside its top k.
  torch::Tensor combine =
      torch::zeros_like(probs).scatter(1, top_experts, top_probs);
  const int ep = sharding.ep_size();
  if (ep > 1) {
    // Dispatch: every rank's tokens and weights, padded to ep_rows (padding
    // rows have zero weight for every expert, so no expert computes them).
    torch::Tensor block = torch::cat({x, combine}, 1);
    block =
        torch::cat({block, torch::zeros({ep_rows - tokens, hidden + experts},
                                        block.options())});
    torch::Tensor all =
        GatherShardedParameter(block, ep * ep_rows, *sharding.ep);
    x = all.narrow(1, 0, hidden);
    combine = all.narrow(1, hidden, experts);
  }
  const int64_t local_experts = experts / ep;
  const int64_t first = sharding.ep_rank() * local_experts;
  torch::Tensor out = torch::zeros_like(x);
  for (int64_t e = 0; e < local_experts; ++e) {
    torch::Tensor weight = combine.select(1, first + e);
    // An expert without tokens still runs (on zero rows): it contributes
    // zero, and its weights get a (zero) gradient on every rank alike.
    torch::Tensor rows = weight.detach().nonzero().squeeze(1);
    torch::Tensor xe = x.index_select(0, rows);
    torch::Tensor ye = torch::linear(
        torch::silu(torch::linear(xe, w.w1[e])) * torch::linear(xe, w.w3[e]),
        w.w2[e]);
    out =
        out.index_add(0, rows, ye * weight.index_select(0, rows).unsqueeze(1));
  }
  if (ep > 1) {
    // Combine: each token's partial outputs summed on its owner.
    out = ReduceScatterRows(out, *sharding.ep).narrow(0, 0, tokens);
  }
  return out.view(h.sizes());
}

namespace {

constexpr char kExpertsInfix[] = ".block_sparse_moe.experts.";

}  // namespace

std::optional<std::pair<std::string, int64_t>> StackedExpertName(
    const std::string& hf_name) {
  const size_t at = hf_name.find(kExpertsInfix);
  if (at == std::string::npos) return std::nullopt;
  const size_t start = at + sizeof(kExpertsInfix) - 1;
  const size_t dot = hf_name.find('.', start);
  int64_t expert = 0;
  if (dot == std::string::npos ||
      !absl::SimpleAtoi(hf_name.substr(start, dot - start), &expert) ||
      expert < 0) {
    return std::nullopt;
  }
  return std::make_pair(hf_name.substr(0, start) + hf_name.substr(dot + 1),
                        expert);
}

NamedTensors ExpertWeightsToHf(NamedTensors tensors) {
  NamedTensors out;
  for (auto& [name, t] : tensors) {
    const size_t at = name.find(kExpertsInfix);
    if (at == std::string::npos) {
      out.emplace_back(std::move(name), std::move(t));
      continue;
    }
    const size_t start = at + sizeof(kExpertsInfix) - 1;
    for (int64_t e = 0; e < t.size(0); ++e) {
      out.emplace_back(
          absl::StrCat(name.substr(0, start), e, ".", name.substr(start)),
          t[e].contiguous());
    }
  }
  return out;
}

absl::StatusOr<NamedTensors> ExpertWeightsFromHf(NamedTensors tensors) {
  NamedTensors out;
  // Stacked name -> (index into out, experts by index).
  std::map<std::string, std::pair<size_t, std::map<int64_t, torch::Tensor>>>
      stacks;
  for (auto& [name, t] : tensors) {
    std::optional<std::pair<std::string, int64_t>> stacked =
        StackedExpertName(name);
    if (!stacked) {
      out.emplace_back(std::move(name), std::move(t));
      continue;
    }
    auto [it, fresh] = stacks.try_emplace(stacked->first);
    if (fresh) {
      it->second.first = out.size();
      out.emplace_back(stacked->first, torch::Tensor());
    }
    if (!it->second.second.emplace(stacked->second, std::move(t)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint weight ", name, " appears more than once"));
    }
  }
  for (auto& [stacked_name, stack] : stacks) {
    std::vector<torch::Tensor> experts;
    for (auto& [e, t] : stack.second) {
      if (e != static_cast<int64_t>(experts.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint weights of ", stacked_name,
                         " miss expert ", experts.size()));
      }
      if (!experts.empty() && t.sizes() != experts[0].sizes()) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint weights of ", stacked_name, ": expert ", e,
                         " has shape ", c10::str(t.sizes()), ", expert 0 ",
                         c10::str(experts[0].sizes())));
      }
      experts.push_back(std::move(t));
    }
    out[stack.first].second = torch::stack(experts);
  }
  return out;
}

}  // namespace tally
