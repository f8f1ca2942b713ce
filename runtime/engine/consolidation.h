// Consolidation: a model split across ranks (sharded over tp / dp_shard / ep,
// or staged over pp) gathered into one whole copy on rank 0, with its
// optimizer state, so that what a checkpoint or an export writes is the same
// whatever the mesh. Rank 0 alone holds the whole copy; every other rank
// helps gather it one tensor at a time.
//
// It takes everything explicitly (this rank's mesh, groups and phase
// boundaries; the model, its optimizer and frozen patterns), so that whatever
// owns a built model can own its consolidation too.
//
//   tally::Consolidation consolidation(mesh, groups, phases);
//   tally::ConsolidatedContents contents;
//   contents.with_optimizer_state = true;
//   TALLY_RETURN_IF_ERROR(consolidation.WriteOnRankZero(
//       {model, optimizer, spec.frozen}, contents,
//       [&](const tally::CausalLm& whole, const tally::Optimizer& opt) {
//         return WriteSomething(path, whole, opt);
//       }));
#ifndef TALLY_RUNTIME_ENGINE_CONSOLIDATION_H_
#define TALLY_RUNTIME_ENGINE_CONSOLIDATION_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "runtime/model/causal_lm.h"
#include "runtime/parallel/engine_groups.h"
#include "runtime/parallel/mesh.h"
#include "runtime/parallel/rank_phases.h"
#include "runtime/train/optimizer.h"

namespace tally {

// Whether `model`'s tensors are split across ranks (sharded, or staged over
// a pp group of more than one rank): what a write consolidates, and what a
// load keeps only this rank's shards of.
bool Staged(const CausalLm& model, const EngineGroups& groups);

// This rank's copy of the model to write.
struct LocalModel {
  CausalLm& model;
  const Optimizer& optimizer;
  // The model's frozen patterns (ModelSpec::frozen): the whole copy freezes
  // the same parameters.
  const std::vector<std::string>& frozen;
};

// What of the model is gathered.
struct ConsolidatedContents {
  // The optimizer state too; without it (a weights-only export) the whole
  // copy's optimizer has no state.
  bool with_optimizer_state = false;
  // The frozen parameters (but LoRA factors) are neither sent nor filled
  // in: what is written leaves them out.
  bool trainable_only = false;
};

class Consolidation {
 public:
  // What rank 0 does with the whole model and its optimizer.
  using WriteFn = std::function<absl::Status(const CausalLm& model,
                                             const Optimizer& optimizer)>;

  // `mesh` and `groups` outlive this.
  Consolidation(const Mesh& mesh, const EngineGroups& groups, RankPhases phases)
      : mesh_(mesh), groups_(groups), phases_(phases) {}

  // Runs `write` on rank 0 with the whole model and its optimizer (gathered
  // there when the model is Staged, every other rank helping; this rank's
  // own copy otherwise) and returns on every rank once all agree on the
  // outcome: how a checkpoint or an export is written. Every rank calls it.
  absl::Status WriteOnRankZero(const LocalModel& local,
                               const ConsolidatedContents& contents,
                               const WriteFn& write) const;

 private:
  // Consolidates a Staged model onto rank 0 (nullptrs elsewhere): the
  // writer's empty copy first, then GatherStages.
  absl::Status GatherOnWriter(const LocalModel& local,
                              const ConsolidatedContents& contents,
                              std::unique_ptr<CausalLm>& full_model,
                              std::unique_ptr<Optimizer>& full_optimizer) const;
  // GatherOnWriter once the writer holds its empty copy: every stage's
  // tensors gathered and sent to it.
  absl::Status GatherStages(const LocalModel& local,
                            const ConsolidatedContents& contents,
                            std::unique_ptr<CausalLm>& full_model,
                            std::unique_ptr<Optimizer>& full_optimizer) const;

  const Mesh& mesh_;
  const EngineGroups& groups_;
  RankPhases phases_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_ENGINE_CONSOLIDATION_H_
