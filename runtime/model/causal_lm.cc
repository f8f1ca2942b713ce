#include "runtime/model/causal_lm.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/model/lora.h"

namespace tally {

torch::ScalarType ToScalarType(DType dtype) {
  return MasterDType(dtype) == DType::kFloat64 ? torch::kFloat64
                                               : torch::kFloat32;
}

torch::ScalarType ComputeScalarType(DType dtype) {
  return dtype == DType::kBFloat16 ? torch::kBFloat16 : ToScalarType(dtype);
}

torch::ScalarType AtLeastFloat32(torch::ScalarType type) {
  return type == torch::kBFloat16 || type == torch::kHalf ? torch::kFloat32
                                                          : type;
}

Parameter* CausalLm::Find(const std::string& name) {
  return const_cast<Parameter*>(std::as_const(*this).Find(name));
}

const Parameter* CausalLm::Find(const std::string& name) const {
  for (const Parameter& p : parameters_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

int CausalLm::FreezeWhere(
    const std::function<bool(const std::string& name)>& frozen) {
  int count = 0;
  for (Parameter& p : parameters_) {
    if (!frozen(p.name)) continue;
    p.trainable = false;
    p.tensor.set_requires_grad(false);
    p.tensor.mutable_grad() = torch::Tensor();
    // ZeRO-1's whole gradient goes too; the gathered copy stays.
    if (p.gathered != nullptr) p.gathered->grad = torch::Tensor();
    ++count;
  }
  return count;
}

void CausalLm::FreezeBase() {
  FreezeWhere([](const std::string& name) { return !IsLoraParameter(name); });
}

int CausalLm::Freeze(const std::string& pattern) {
  return FreezeWhere(
      [&](const std::string& name) { return NameMatches(pattern, name); });
}

absl::Status CausalLm::To(const torch::Device& device) {
  const std::string what = absl::StrCat("place the model on ", device.str());
  return CatchTorch(what.c_str(), [&] {
    torch::NoGradGuard no_grad;
    for (Parameter& p : parameters_) {
      if (p.tensor.device() != device) p.tensor.set_data(p.tensor.to(device));
    }
    WeightsChanged();
  });
}

torch::Device CausalLm::device() const {
  return parameters_.empty() ? torch::Device(torch::kCPU)
                             : parameters_.front().tensor.device();
}

absl::Status CausalLm::set_recompute_layers(bool recompute) {
  if (recompute && routed_experts() > 0) {
    return absl::InvalidArgumentError(
        "activation_checkpointing is not implemented for mixture-of-experts "
        "models (their layers return routing statistics besides the hidden "
        "states)");
  }
  recompute_layers_ = recompute;
  return absl::OkStatus();
}

uint64_t CausalLm::NumParameters() const {
  uint64_t n = 0;
  for (const Parameter& p : parameters_) {
    uint64_t numel = 1;
    for (int64_t size : p.full_shape) numel *= size;
    n += numel;
  }
  return n;
}

torch::Tensor CausalLm::LocalShard(const Parameter& p,
                                   const torch::Tensor& full) const {
  return LocalShardOf(p, full, sharding_);
}

absl::StatusOr<torch::Tensor> CausalLm::GatherFull(const Parameter& p,
                                                   const torch::Tensor& local) {
  return GatherFullOf(p, local, sharding_);
}

torch::Tensor CausalLm::TargetLogprobs(const torch::Tensor& inputs,
                                       const torch::Tensor& targets,
                                       const AttentionLayout& layout,
                                       StageIo* io) {
  TORCH_CHECK(sharding_.pp_stages == 1,
              "TargetLogprobs needs the whole model; use StageForward");
  if (io != nullptr) io->auxiliary.clear();
  return StageForward(inputs, targets, layout, io);
}

torch::Tensor CausalLm::ComputeCopy(int index) const {
  if (static_cast<size_t>(index) < base_index_.size() &&
      base_index_[index] >= 0) {
    return base()->ComputeCopy(base_index_[index]);
  }
  return compute_weights_.CopyOf(index, parameters_[index].tensor,
                                 compute_type());
}

int64_t CausalLm::ComputeWeightBytes() const {
  const int64_t own = compute_weights_.bytes();
  return base() == nullptr ? own : own + base()->compute_weights_.bytes();
}

absl::StatusOr<torch::Tensor> CausalLm::ForwardWithCache(
    const torch::Tensor& /*input*/, const torch::Tensor& /*positions*/,
    const torch::Tensor& /*valid*/, KvCache& /*cache*/,
    const torch::Tensor& /*logits_at*/) {
  return absl::UnimplementedError(absl::StrCat(
      "decoding with a KV cache is not implemented for model_type ",
      config_.ResolvedModelType()));
}

absl::StatusOr<int> CausalLm::AddPlaceholder(const ParameterSpec& spec,
                                             const ShardingPlan& plan) {
  if (sharded() || sharding_.pp_stages > 1) {
    return absl::InternalError("base placeholders are for unsharded models");
  }
  TALLY_ASSIGN_OR_RETURN(const PlanRule* rule, plan.RuleFor(spec.name));
  Parameter p = PlaceParameter(spec.name, spec.shape, *rule, sharding_);
  // One element, broadcast to the full shape.
  p.tensor = torch::zeros({}, torch::TensorOptions().dtype(scalar_type()))
                 .expand(spec.shape);
  p.trainable = false;
  parameters_.push_back(std::move(p));
  return static_cast<int>(parameters_.size()) - 1;
}

absl::StatusOr<std::vector<int>> CausalLm::InitializeParameters(
    const std::vector<ParameterSpec>& specs, const ShardingPlan& plan,
    uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Generator adapter_generator =
      at::make_generator<at::CPUGeneratorImpl>(lora().seed.value_or(seed));
  const auto options = torch::TensorOptions().dtype(scalar_type());
  std::vector<int> indices;
  indices.reserve(specs.size());
  for (const ParameterSpec& spec : specs) {
    const bool adapter = IsLoraParameter(spec.name);
    if (base() != nullptr && !adapter) {
      // The base's tensor itself (its storage shared, frozen).
      const Parameter* shared = base()->Find(spec.name);
      if (spec.held != (shared != nullptr)) {
        return absl::InternalError(absl::StrCat(
            "the shared base does not match the model at ", spec.name));
      }
      if (shared != nullptr) {
        parameters_.push_back(*shared);
        base_index_.resize(parameters_.size(), -1);
        base_index_.back() =
            static_cast<int>(shared - base()->parameters().data());
      }
      indices.push_back(
          shared != nullptr ? static_cast<int>(parameters_.size()) - 1 : -1);
      continue;
    }
    if (adapters_.base_placeholders && !adapter) {
      TALLY_ASSIGN_OR_RETURN(int index, AddPlaceholder(spec, plan));
      indices.push_back(index);
      continue;
    }
    // Every stage draws every tensor, so each is the same whatever the
    // split; only the held ones are kept.
    torch::Tensor full;
    switch (spec.init) {
      case ParameterInit::kNormal:
        full = torch::empty(spec.shape, options).normal_(0.0, 0.02, generator);
        break;
      case ParameterInit::kKaimingUniform: {
        const double bound =
            1.0 / std::sqrt(static_cast<double>(spec.shape[1]));
        full = torch::empty(spec.shape, options)
                   .uniform_(-bound, bound,
                             adapter ? adapter_generator : generator);
        break;
      }
      case ParameterInit::kOnes:
        full = torch::ones(spec.shape, options);
        break;
      case ParameterInit::kZeros:
        full = torch::zeros(spec.shape, options);
        break;
    }
    if (!spec.held) {
      indices.push_back(-1);
      continue;
    }
    TALLY_ASSIGN_OR_RETURN(const PlanRule* rule, plan.RuleFor(spec.name));
    Parameter p = PlaceParameter(spec.name, spec.shape, *rule, sharding_);
    p.tensor = LocalShard(p, full).set_requires_grad(true);
    parameters_.push_back(std::move(p));
    indices.push_back(static_cast<int>(parameters_.size()) - 1);
  }
  return indices;
}

}  // namespace tally
