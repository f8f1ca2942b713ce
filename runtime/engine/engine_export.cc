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
  return state->built->ExportWeights(path, options);
}

}  // namespace tally
