#include "runtime/engine/consolidation.h"

#include <map>
#include <utility>

#include "base/status.h"
#include "runtime/model/freeze_parameters.h"
#include "runtime/model/lora.h"
#include "runtime/parallel/fault_hook.h"

namespace tally {

bool Staged(const CausalLm& model, const EngineGroups& groups) {
  return model.sharded() || groups.pp->size() > 1;
}

absl::Status Consolidation::WriteOnRankZero(
    const LocalModel& local, const ConsolidatedContents& contents,
    const WriteFn& write) const {
  const CausalLm* model = &local.model;
  const Optimizer* optimizer = &local.optimizer;
  const bool writer = mesh_.rank() == 0;
  std::unique_ptr<CausalLm> full_model;
  std::unique_ptr<Optimizer> full_optimizer;
  // One writer. A sharded or staged model is consolidated so the directory
  // is the same whatever the mesh: only the writer holds the whole copy; the
  // other ranks help gather it one tensor at a time.
  if (Staged(*model, groups_)) {
    TALLY_RETURN_IF_ERROR(phases_.Finish(
        GatherOnWriter(local, contents, full_model, full_optimizer)));
    if (writer) {
      model = full_model.get();
      optimizer = full_optimizer.get();
    }
  }
  // Only the writer writes: the others wait in the agreement.
  absl::Status written = InjectedFault(FaultPoint::kWrite);
  if (writer && written.ok()) written = write(*model, *optimizer);
  return phases_.Agree(written);
}

absl::Status Consolidation::GatherOnWriter(
    const LocalModel& local, const ConsolidatedContents& contents,
    std::unique_ptr<CausalLm>& full_model,
    std::unique_ptr<Optimizer>& full_optimizer) const {
  const CausalLm& model = local.model;
  absl::Status ready = absl::OkStatus();
  if (mesh_.rank() == 0) {
    ModelAdapters adapters;
    adapters.lora = model.lora();
    // What is written leaves the base out: no need to hold it.
    adapters.base_placeholders =
        contents.trainable_only && model.lora().enabled();
    absl::StatusOr<std::unique_ptr<CausalLm>> created =
        CreateCausalLm(model.config(), model.dtype(), /*seed=*/0, {}, adapters);
    ready = created.status();
    if (ready.ok()) {
      full_model = *std::move(created);
      if (model.lora().enabled()) full_model->FreezeBase();
      ready = FreezeParameters(local.frozen, *full_model);
    }
  }
  // Before the gathers, so a writer that could not allocate stops every
  // rank rather than leaving them in a collective.
  TALLY_RETURN_IF_ERROR(phases_.Agree(ready));
  return GatherStages(local, contents, full_model, full_optimizer);
}

absl::Status Consolidation::GatherStages(
    const LocalModel& local, const ConsolidatedContents& contents,
    std::unique_ptr<CausalLm>& full_model,
    std::unique_ptr<Optimizer>& full_optimizer) const {
  CausalLm& model = local.model;
  const bool trainable_only = contents.trainable_only;
  const bool writer = mesh_.rank() == 0;
  // Each stage gathers the parameters it owns (the last stage's copy of a
  // tied embedding is stage 0's) over its tp and dp_shard groups, in the
  // model's order, each parameter followed by its optimizer state.
  const int stages = groups_.pp->size(), stage = groups_.pp->rank();
  const std::map<std::string, torch::Tensor> state_tensors = [&] {
    std::map<std::string, torch::Tensor> by_name;
    for (auto& [name, t] : local.optimizer.StateTensors()) by_name[name] = t;
    return by_name;
  }();
  // Of every trainable parameter; frozen ones have no state.
  const std::vector<std::string> state_suffixes =
      contents.with_optimizer_state
          ? Optimizer::StateSuffixes(local.optimizer.kind())
          : std::vector<std::string>();
  std::vector<torch::Tensor> stage_tensors;
  for (const Parameter& p : model.parameters()) {
    if (model.OwningStage(p.name, stages) != stage) continue;
    if (trainable_only && !p.trainable && !IsLoraParameter(p.name)) continue;
    TALLY_RETURN_IF_ERROR(InjectedFault(FaultPoint::kGather));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor full, model.GatherFull(p, p.tensor));
    stage_tensors.push_back(std::move(full));
    if (!p.trainable) continue;
    for (const std::string& suffix : state_suffixes) {
      TALLY_ASSIGN_OR_RETURN(
          full, model.GatherFull(p, state_tensors.at(p.name + suffix)));
      stage_tensors.push_back(std::move(full));
    }
  }
  // A stage's gathered tensors sit on its rank at coordinate 0 of every
  // other dim: the one that shares rank 0's pp group, where they are sent.
  const bool stage_leader = mesh_.coord(MeshDim::kDpReplicate) == 0 &&
                            mesh_.coord(MeshDim::kDpShard) == 0 &&
                            mesh_.coord(MeshDim::kCp) == 0 &&
                            mesh_.coord(MeshDim::kTp) == 0;
  if (stage_leader && !writer) {
    for (const torch::Tensor& t : stage_tensors) {
      TALLY_RETURN_IF_ERROR(groups_.pp->Send(t, 0));
    }
  }
  if (!writer) return absl::OkStatus();
  std::vector<std::pair<std::string, torch::Tensor>> full_state;
  size_t own = 0;
  for (int s = 0; s < stages; ++s) {
    for (Parameter& p : full_model->parameters()) {
      if (full_model->OwningStage(p.name, stages) != s) continue;
      if (trainable_only && !p.trainable && !IsLoraParameter(p.name)) {
        continue;
      }
      const size_t states = p.trainable ? state_suffixes.size() : 0;
      for (size_t k = 0; k <= states; ++k) {
        torch::Tensor full;
        if (s == 0) {
          full = stage_tensors[own++];
        } else {
          full = torch::empty(p.full_shape, p.tensor.options());
          TALLY_RETURN_IF_ERROR(groups_.pp->Recv(full, s));
        }
        if (k > 0) {
          full_state.emplace_back(p.name + state_suffixes[k - 1],
                                  std::move(full));
          continue;
        }
        torch::NoGradGuard no_grad;
        p.tensor.copy_(full);
      }
    }
  }
  full_optimizer = std::make_unique<Optimizer>(local.optimizer.kind(),
                                               &full_model->parameters());
  if (!contents.with_optimizer_state) return absl::OkStatus();
  return full_optimizer->LoadState(full_state, local.optimizer.step_count());
}

}  // namespace tally
