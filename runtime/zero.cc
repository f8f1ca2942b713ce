#include "runtime/zero.h"

#include "base/status.h"
#include "runtime/parallel_ops.h"

namespace tally {

torch::Tensor GatheredWeight(const Parameter& p, Communicator& dp_shard) {
  GatheredCopy& copy = *p.gathered;
  TORCH_CHECK(copy.value.defined(), "the gathered copy of ", p.name,
              " was never refreshed");
  // A frozen parameter (or a pass without autograd) needs no graph.
  if (!p.tensor.requires_grad() || !torch::GradMode::is_enabled()) {
    return copy.value;
  }
  return UseGatheredCopy(p.tensor, copy, dp_shard);
}

absl::Status RefreshGatheredCopies(std::vector<Parameter>& params,
                                   torch::ScalarType compute,
                                   Communicator& dp_shard,
                                   bool trainable_only) {
  for (Parameter& p : params) {
    if (p.gathered == nullptr || (trainable_only && !p.trainable)) continue;
    torch::Tensor shard;
    TALLY_RETURN_IF_ERROR(CatchTorch("cast a shard for its gather", [&] {
      shard = p.tensor.detach().to(compute).contiguous();
    }));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor gathered, dp_shard.AllGather(shard));
    TALLY_RETURN_IF_ERROR(CatchTorch("keep a gathered copy", [&] {
      GatheredCopy& copy = *p.gathered;
      copy.value = gathered.narrow(0, 0, p.tp_local_shape[0]);
      if (copy.whole_gradient && p.trainable && !copy.grad.defined()) {
        copy.grad = torch::zeros(p.tp_local_shape, p.tensor.options());
      }
    }));
  }
  return absl::OkStatus();
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
  for (Parameter& p : params) {
    if (!p.trainable || p.gathered == nullptr || !p.gathered->whole_gradient) {
      continue;
    }
    GatheredCopy& copy = *p.gathered;
    TALLY_ASSIGN_OR_RETURN(torch::Tensor shard_grad,
                           ReduceScatterShards(copy.grad, dp_shard));
    TALLY_RETURN_IF_ERROR(CatchTorch("add a reduced whole gradient", [&] {
      torch::NoGradGuard no_grad;
      torch::Tensor& grad = p.tensor.mutable_grad();
      grad = grad.defined() ? grad.add_(shard_grad) : shard_grad;
      copy.grad.zero_();
    }));
  }
  return absl::OkStatus();
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
