// FreezeParameters: a model's frozen patterns (ModelSpec::frozen) applied to
// one of its copies, refusing a pattern that names nothing. Shared by the
// model a rank builds and the whole copy a consolidation fills
// (runtime/engine/consolidation.h), so both freeze the same parameters.
//
//   TALLY_RETURN_IF_ERROR(tally::FreezeParameters(spec.frozen, *model));
#ifndef TALLY_RUNTIME_MODEL_FREEZE_PARAMETERS_H_
#define TALLY_RUNTIME_MODEL_FREEZE_PARAMETERS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "runtime/model/causal_lm.h"

namespace tally {

// Freezes what `patterns` match (CausalLm::Freeze); INVALID_ARGUMENT naming
// a pattern that matches no parameter of the whole model (this stage may
// hold none).
absl::Status FreezeParameters(const std::vector<std::string>& patterns,
                              CausalLm& model);

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_FREEZE_PARAMETERS_H_
