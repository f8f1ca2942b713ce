#include "runtime/parallel/zero.h"

#include "base/status.h"
#include "runtime/parallel/fault_hook.h"
#include "runtime/parallel/parallel_ops.h"

namespace tally {
torch::Tensor GatheredWeight(const Parameter& p, Communicator& dp_shard,
                             Communicator* tp_sum) {
  GatheredCopy& copy = *p.gathered;
  TORCH_CHECK(copy.value.defined(), "the gathered copy of ", p.name,
              " was never refreshed");
  // A frozen parameter (or a pass without autograd) needs no graph.
  if (!p.tensor.requires_grad() || !torch::GradMode::is_enabled()) {
    return copy.value;
  }
  return UseGatheredCopy(p.tensor, copy, dp_shard, tp_sum);
}

absl::Status RefreshGatheredCopies(
    std::vector<Parameter>& params, torch::ScalarType compute,
    Communicator& dp_shard,
    const std::function<bool(const Parameter& p)>& selected) {
  std::vector<Parameter*> chosen;
  std::vector<torch::Tensor> shards;
  const absl::Status cast = CatchTorch("cast the shards to gather", [&] {
    for (Parameter& p : params) {
      if (p.gathered == nullptr || !selected(p)) continue;
      chosen.push_back(&p);
      shards.push_back(p.tensor.detach().to(compute).contiguous());
    }
  });
  TALLY_RETURN_IF_ERROR(
      AgreeOnStatus(dp_shard, cast, "to cast its shards for their gather"));
  std::vector<torch::Tensor> gathered;
  for (torch::Tensor& shard : shards) {
    TALLY_RETURN_IF_ERROR(InjectedFault(FaultPoint::kRefreshGathered));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor full, dp_shard.AllGather(shard));
    shard = torch::Tensor();
    gathered.push_back(std::move(full));
  }
  return CatchTorch("keep the gathered copies", [&] {
    for (size_t i = 0; i < chosen.size(); ++i) {
      // Without the padding rows of the last shard.
      const int64_t rows = chosen[i]->tp_local_shape[0];
      chosen[i]->gathered->value = gathered[i].size(0) == rows
                                       ? gathered[i]
                                       : gathered[i].narrow(0, 0, rows).clone();
    }
  });
}

bool KeepsWholeGradients(const std::vector<Parameter>& params) {
  for (const Parameter& p : params) {
    if (p.trainable && p.gathered != nullptr && p.gathered->whole_gradient) {
      return true;
    }
  }
  return false;
}

absl::Status ReduceWholeGradients(std::vector<Parameter>& params,
                                  Communicator& dp_shard) {
  std::vector<Parameter*> chosen;
  std::vector<torch::Tensor> reduced;
  for (Parameter& p : params) {
    if (!p.trainable || p.gathered == nullptr || !p.gathered->whole_gradient) {
      continue;
    }
    TALLY_RETURN_IF_ERROR(InjectedFault(FaultPoint::kGradientSync));
    const torch::Tensor& whole = p.gathered->grad;
    TALLY_ASSIGN_OR_RETURN(
        torch::Tensor shard_grad,
        ReduceScatterShards(whole.defined() ? whole
                                            : torch::zeros(p.tp_local_shape,
                                                           p.tensor.options()),
                            dp_shard));
    chosen.push_back(&p);
    reduced.push_back(std::move(shard_grad));
  }
  return CatchTorch("add the reduced whole gradients", [&] {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < chosen.size(); ++i) {
      torch::Tensor& grad = chosen[i]->tensor.mutable_grad();
      grad = grad.defined() ? grad.add_(reduced[i]) : reduced[i];
      if (chosen[i]->gathered->grad.defined()) {
        chosen[i]->gathered->grad.zero_();
      }
    }
  });
}

GatheredBytes GatheredStateBytes(const std::vector<Parameter>& params) {
  GatheredBytes bytes;
  for (const Parameter& p : params) {
    if (p.gathered == nullptr) continue;
    if (p.gathered->value.defined()) {
      bytes.parameters += static_cast<double>(p.gathered->value.nbytes());
    }
    if (p.gathered->grad.defined()) {
      bytes.gradients += static_cast<double>(p.gathered->grad.nbytes());
    }
  }
  return bytes;
}

}  // namespace tally
