#include "runtime/train/gradient_sync.h"

#include <utility>

#include "base/status.h"
#include "runtime/parallel/zero.h"

namespace tally {

GradientSync::GradientSync(CausalLm& model, const EngineGroups& groups,
                           int64_t bucket_bytes)
    : model_(model),
      dp_shard_(*groups.dp_shard),
      pp_(*groups.pp),
      bucket_bytes_(bucket_bytes) {
  whole_gradients_ = KeepsWholeGradients(model.parameters());
  GradientSet dense{groups.replicas, {}};
  GradientSet expert{groups.expert_replicas, {}};
  for (const Parameter& p : model.parameters()) {
    if (!p.trainable) continue;  // no gradient to sum
    (p.is_expert ? expert : dense).parameters.push_back(p);
  }
  for (GradientSet* set : {&dense, &expert}) {
    if (set->group->size() > 1 && !set->parameters.empty()) {
      replica_sets_.push_back(std::move(*set));
    }
  }
  tied_ = model.SplitTiedEmbedding();
  needed_ =
      whole_gradients_ || groups.replicas->size() > 1 ||
      (model.routed_experts() > 0 && groups.expert_replicas->size() > 1) ||
      tied_ != nullptr;
}

absl::Status GradientSync::SumAccumulated() {
  return needed_ ? Sum(/*overlapped=*/nullptr) : absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CallGradientSum>> GradientSync::BeginCall(
    bool overlap) {
  std::unique_ptr<CallGradientSum> call(new CallGradientSum(*this));
  for (Parameter& p : model_.parameters()) {
    call->earlier_.push_back(p.tensor.grad());
    p.tensor.mutable_grad() = torch::Tensor();
  }
  // Nothing to overlap when only a tied embedding needs its stages' sum.
  if (overlap && !replica_sets_.empty() && !whole_gradients_) {
    for (const GradientSet& set : replica_sets_) {
      call->overlapped_groups_.push_back(set.group);
    }
    TALLY_ASSIGN_OR_RETURN(
        call->overlapped_,
        OverlappedGradientSum::Create(replica_sets_, bucket_bytes_));
  }
  return call;
}

absl::Status GradientSync::Sum(OverlappedGradientSum* overlapped) {
  // ZeRO-1: the window's (or call's) whole gradients into the shards first,
  // so that the replicas sum shards as under every other stage.
  if (whole_gradients_) {
    TALLY_RETURN_IF_ERROR(ReduceWholeGradients(model_.parameters(), dp_shard_));
  }
  // Each replica set in flat buckets. Copies of a Parameter share its
  // tensor, so the sums land in the model.
  if (overlapped != nullptr) {
    TALLY_RETURN_IF_ERROR(overlapped->Finish());
  } else {
    for (GradientSet& set : replica_sets_) {
      TALLY_RETURN_IF_ERROR(AllReduceGradientsInBuckets(
          set.parameters, *set.group, bucket_bytes_));
    }
  }
  return tied_ == nullptr ? absl::OkStatus() : SumTiedEmbedding();
}

absl::Status GradientSync::SumTiedEmbedding() {
  // The first and last stage swap their (replica-summed) gradients of the
  // tied embedding and each adds the two: IEEE addition commutes, so both
  // copies get the same bits and stay identical after the step.
  const int peer = model_.first_stage() ? pp_.size() - 1 : 0;
  torch::Tensor own = tied_->tensor.grad().defined()
                          ? tied_->tensor.grad()
                          : torch::zeros_like(tied_->tensor);
  torch::Tensor other = torch::empty_like(own);
  TALLY_RETURN_IF_ERROR(pp_.SendRecv(own, peer, other, peer));
  return CatchTorch("sum the tied embedding", [&] {
    torch::NoGradGuard no_grad;
    tied_->tensor.mutable_grad() = own + other;
  });
}

void CallGradientSum::ArmForLastBackward() {
  if (overlapped_) overlapped_->Arm();
}

absl::Status CallGradientSum::Finish() {
  TALLY_RETURN_IF_ERROR(sync_.Sum(overlapped_.get()));
  std::vector<Parameter>& params = sync_.model_.parameters();
  return CatchTorch("accumulate gradients", [&] {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!earlier_[i].defined()) continue;
      torch::Tensor& grad = params[i].tensor.mutable_grad();
      grad = grad.defined() ? grad.add_(earlier_[i]) : earlier_[i];
    }
  });
}

}  // namespace tally
