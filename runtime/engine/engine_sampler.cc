// The engine's sampler snapshots (sampler_snapshots.h): each model keeps its
// own, so DeleteModel takes them along; Sample and ComputeLogprobs swap one
// in for the call (WeightsToSample).
#include "base/status.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/sampler_snapshots.h"

namespace tally {

absl::StatusOr<SamplerSummary> Engine::SaveWeightsForSampler(
    const std::string& model_id, const std::string& name) {
  TALLY_RETURN_IF_ERROR(ValidateSamplerName(name));
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_RETURN_IF_ERROR(CheckIntact(*state));
  TALLY_RETURN_IF_ERROR(state->samplers.CheckNew(model_id, name));
  // A copy can fail on one rank only (memory): the ranks agree before any
  // of them keeps its copy.
  absl::StatusOr<SamplerSnapshot> snapshot =
      SamplerSnapshot::Take(state->built->model(), state->step);
  TALLY_RETURN_IF_ERROR(phases().Agree(snapshot.status()));
  state->samplers.Add(name, *std::move(snapshot));
  TALLY_ASSIGN_OR_RETURN(const SamplerSnapshot* added,
                         state->samplers.Find(model_id, name));
  return SamplerSummary{model_id,         name,
                        added->step(),    added->bytes(),
                        added->created(), added->is_adapter()};
}

absl::StatusOr<std::vector<SamplerSummary>> Engine::ListSamplers(
    const std::string& model_id) const {
  if (!model_id.empty()) {
    TALLY_ASSIGN_OR_RETURN(const ModelState* state, Find(model_id));
    return state->samplers.List(model_id);
  }
  std::vector<SamplerSummary> out;
  for (const auto& [id, state] : models_) {
    for (SamplerSummary& summary : state->samplers.List(id)) {
      out.push_back(std::move(summary));
    }
  }
  return out;
}

absl::StatusOr<SamplerSummary> Engine::DeleteSampler(
    const std::string& model_id, const std::string& name) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  return state->samplers.Remove(model_id, name);
}

absl::StatusOr<std::unique_ptr<SwappedInWeights>> Engine::WeightsToSample(
    ModelState& state, const std::string& sampler, int64_t* step) {
  if (sampler.empty()) {
    TALLY_RETURN_IF_ERROR(CheckIntact(state));
    *step = state.step;
    return nullptr;
  }
  // A snapshot holds every weight a damage could have touched (a LoRA
  // model's base is frozen): it samples whatever the live ones are.
  TALLY_ASSIGN_OR_RETURN(const SamplerSnapshot* snapshot,
                         state.samplers.Find(state.spec().model_id, sampler));
  *step = snapshot->step();
  return std::make_unique<SwappedInWeights>(state.built->model(), *snapshot);
}

}  // namespace tally
