#include "runtime/parallel/sharding_plan.h"

#include <cctype>
#include <memory>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/parallel/parallel_ops.h"

namespace tally {
bool NameMatches(const std::string& pattern, const std::string& name) {
  size_t n = 0;
  for (const char c : pattern) {
    if (c != '*') {
      if (n >= name.size() || name[n] != c) return false;
      ++n;
      continue;
    }
    const size_t digits_start = n;
    while (n < name.size() && std::isdigit(static_cast<unsigned char>(name[n])))
      ++n;
    if (n == digits_start) return false;
  }
  return n == name.size();
}

absl::StatusOr<const PlanRule*> ShardingPlan::RuleFor(
    const std::string& name) const {
  for (const PlanRule& rule : rules) {
    if (NameMatches(rule.pattern, name)) return &rule;
  }
  return absl::InternalError(
      absl::StrCat("the sharding plan has no rule for parameter ", name));
}

Parameter PlaceParameter(const std::string& name,
                         const std::vector<int64_t>& shape,
                         const PlanRule& rule, const ModelSharding& sharding) {
  Parameter p;
  p.name = name;
  p.full_shape = shape;
  p.tp_local_shape = shape;
  p.is_expert = rule.style == ParallelStyle::kExpert;
  const int tp_dim = rule.style == ParallelStyle::kColumnwise ? 0
                     : rule.style == ParallelStyle::kRowwise  ? 1
                                                              : -1;
  if (p.is_expert) {
    p.placements.Set(MeshDim::kEp, Placement::Shard(0));
  } else if (tp_dim >= 0 && sharding.tp_size() > 1) {
    p.placements.Set(MeshDim::kTp, Placement::Shard(tp_dim));
    p.tp_local_shape[tp_dim] /= sharding.tp_size();
  }
  if (!p.is_expert && sharding.dp_shard_size() > 1) {
    p.placements.Set(MeshDim::kDpShard, Placement::Shard(0));
    if (sharding.keeps_gathered()) {
      p.gathered = std::make_shared<GatheredCopy>();
      p.gathered->whole_gradient =
          sharding.zero_stage == ZeroStage::kOptimizerState;
    }
  }
  if (sharding.pp_stages > 1 && !rule.shared_across_stages) {
    p.placements.Set(MeshDim::kPp, Placement::Shard(0));
  }
  return p;
}

torch::Tensor LocalShardOf(const Parameter& p, const torch::Tensor& full,
                           const ModelSharding& sharding) {
  torch::Tensor local = full;
  if (p.placements.at(MeshDim::kEp).is_shard()) {
    local = local.chunk(sharding.ep_size(), 0)[sharding.ep_rank()];
  }
  const Placement& tp = p.placements.at(MeshDim::kTp);
  if (tp.is_shard()) {
    local = local.chunk(sharding.tp_size(), tp.shard_dim())[sharding.tp_rank()];
  }
  if (p.placements.at(MeshDim::kDpShard).is_shard()) {
    local =
        ShardDim0(local, sharding.dp_shard_rank(), sharding.dp_shard_size());
  }
  return local.contiguous().clone();
}

absl::StatusOr<torch::Tensor> GatherFullOf(const Parameter& p,
                                           const torch::Tensor& local,
                                           const ModelSharding& sharding) {
  torch::Tensor t = local.detach();
  if (p.placements.at(MeshDim::kEp).is_shard() && sharding.ep_size() > 1) {
    TALLY_ASSIGN_OR_RETURN(t, sharding.ep->AllGather(t.contiguous()));
  }
  if (p.placements.at(MeshDim::kDpShard).is_shard()) {
    TALLY_ASSIGN_OR_RETURN(t, sharding.dp_shard->AllGather(t));
    t = t.narrow(0, 0, p.tp_local_shape[0]);
  }
  const Placement& tp = p.placements.at(MeshDim::kTp);
  if (tp.is_shard()) {
    // AllGather concatenates along dim 0: move the split dim there and back.
    const int dim = tp.shard_dim();
    TALLY_ASSIGN_OR_RETURN(
        t, sharding.tp->AllGather(t.transpose(0, dim).contiguous()));
    t = t.transpose(0, dim);
  }
  return t.contiguous();
}

}  // namespace tally
