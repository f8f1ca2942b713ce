// Engine::ExportWeights: the weights, consolidated on rank 0, as an HF model
// directory (weights_export.h).
#include "base/status.h"
#include "runtime/checkpoint/weights_export.h"
#include "runtime/engine/engine.h"

namespace tally {

absl::StatusOr<ExportResult> Engine::ExportWeights(
    const std::string& model_id, const std::string& path,
    const ExportOptions& options) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_RETURN_IF_ERROR(CheckIntact(*state));
  // No window check: gradients are not weights, so a pending window is
  // neither exported nor touched.
  ExportResult result;
  // A PEFT export writes the adapter only: the frozen base stays unsent.
  TALLY_RETURN_IF_ERROR(consolidation().WriteOnRankZero(
      {*state->model, *state->optimizer, state->spec.frozen},
      {/*with_optimizer_state=*/false,
       /*trainable_only=*/state->spec.lora.enabled() && !options.merge},
      [&](const CausalLm& model, const Optimizer&) -> absl::Status {
        TALLY_ASSIGN_OR_RETURN(result,
                               WriteWeightsExport(path, model, options,
                                                  state->spec.init_checkpoint));
        return absl::OkStatus();
      }));
  return result;
}

}  // namespace tally
