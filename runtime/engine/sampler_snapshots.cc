#include "runtime/engine/sampler_snapshots.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "runtime/model/lora.h"

namespace tally {
namespace {

uint64_t BytesOf(const torch::Tensor& tensor) {
  return tensor.defined() ? static_cast<uint64_t>(tensor.nbytes()) : 0;
}

}  // namespace

absl::StatusOr<SamplerSnapshot> SamplerSnapshot::Take(const CausalLm& model,
                                                      int64_t step) {
  SamplerSnapshot snapshot;
  snapshot.step_ = step;
  snapshot.created_ = absl::Now();
  snapshot.is_adapter_ = model.lora().enabled();
  TALLY_RETURN_IF_ERROR(CatchTorch("copying the weights for a sampler", [&] {
    torch::NoGradGuard no_grad;
    const std::vector<Parameter>& parameters = model.parameters();
    for (size_t i = 0; i < parameters.size(); ++i) {
      const Parameter& p = parameters[i];
      // A LoRA model's base is frozen and shared: read as it is.
      if (snapshot.is_adapter_ && !IsLoraParameter(p.name)) continue;
      Frozen frozen;
      frozen.index = i;
      frozen.tensor = p.tensor.detach().clone();
      if (p.gathered != nullptr) {
        frozen.gathered = std::make_shared<GatheredCopy>();
        frozen.gathered->whole_gradient = p.gathered->whole_gradient;
        if (p.gathered->value.defined()) {
          frozen.gathered->value = p.gathered->value.detach().clone();
        }
      }
      snapshot.bytes_ += BytesOf(frozen.tensor);
      if (frozen.gathered != nullptr) {
        snapshot.bytes_ += BytesOf(frozen.gathered->value);
      }
      snapshot.frozen_.push_back(std::move(frozen));
    }
  }));
  return snapshot;
}

SwappedInWeights::SwappedInWeights(CausalLm& model,
                                   const SamplerSnapshot& snapshot)
    : model_(model) {
  std::vector<Parameter>& parameters = model_.parameters();
  live_.reserve(snapshot.frozen_.size());
  for (const SamplerSnapshot::Frozen& frozen : snapshot.frozen_) {
    Parameter& p = parameters[frozen.index];
    live_.push_back({frozen.index, p.tensor, p.gathered});
    p.tensor = frozen.tensor;
    p.gathered = frozen.gathered;
  }
}

SwappedInWeights::~SwappedInWeights() {
  std::vector<Parameter>& parameters = model_.parameters();
  for (SamplerSnapshot::Frozen& live : live_) {
    Parameter& p = parameters[live.index];
    p.tensor = std::move(live.tensor);
    p.gathered = std::move(live.gathered);
  }
}

absl::Status SamplerSnapshots::CheckNew(const std::string& model_id,
                                        const std::string& name) const {
  if (snapshots_.count(name) == 0) return absl::OkStatus();
  return absl::AlreadyExistsError(
      absl::StrCat("sampler '", name, "' of model '", model_id,
                   "' already exists; DeleteSampler it or choose another "
                   "name"));
}

void SamplerSnapshots::Add(const std::string& name, SamplerSnapshot snapshot) {
  snapshots_.insert_or_assign(name, std::move(snapshot));
}

absl::StatusOr<const SamplerSnapshot*> SamplerSnapshots::Find(
    const std::string& model_id, const std::string& name) const {
  auto it = snapshots_.find(name);
  if (it == snapshots_.end()) {
    return absl::NotFoundError(absl::StrCat("sampler '", name, "' of model '",
                                            model_id, "' not found"));
  }
  return &it->second;
}

namespace {

SamplerSummary Summarize(const std::string& model_id, const std::string& name,
                         const SamplerSnapshot& snapshot) {
  return {model_id,           name,
          snapshot.step(),    snapshot.bytes(),
          snapshot.created(), snapshot.is_adapter()};
}

}  // namespace

absl::StatusOr<SamplerSummary> SamplerSnapshots::Remove(
    const std::string& model_id, const std::string& name) {
  TALLY_ASSIGN_OR_RETURN(const SamplerSnapshot* snapshot, Find(model_id, name));
  SamplerSummary summary = Summarize(model_id, name, *snapshot);
  snapshots_.erase(name);
  return summary;
}

std::vector<SamplerSummary> SamplerSnapshots::List(
    const std::string& model_id) const {
  std::vector<SamplerSummary> out;
  for (const auto& [name, snapshot] : snapshots_) {
    out.push_back(Summarize(model_id, name, snapshot));
  }
  return out;
}

}  // namespace tally
