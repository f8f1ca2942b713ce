// Engine::Sample and Engine::ComputeLogprobs: the model's weights after its
// last OptimStep, read without gradients (sample_call.h).
#include "base/status.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/sample_call.h"

namespace tally {

absl::StatusOr<SampleCallResult> Engine::Sample(const std::string& model_id,
                                                const SampleArgs& args) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_RETURN_IF_ERROR(CheckIntact(*state));
  TALLY_RETURN_IF_ERROR(CheckSamplingMesh(mesh_, "Sample"));
  // No window check: sampling reads the weights, not the gradients, so a
  // pending window is neither blocked nor touched.
  TALLY_ASSIGN_OR_RETURN(
      SampleCallResult result,
      RunSampleCall(state->built->model(), args, state->eos_token_ids));
  result.step = state->step;
  return result;
}

absl::StatusOr<LogprobsCallResult> Engine::ComputeLogprobs(
    const std::string& model_id, const LogprobsArgs& args) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  TALLY_RETURN_IF_ERROR(CheckIntact(*state));
  TALLY_RETURN_IF_ERROR(CheckSamplingMesh(mesh_, "ComputeLogprobs"));
  TALLY_ASSIGN_OR_RETURN(LogprobsCallResult result,
                         RunLogprobsCall(state->built->model(), args));
  result.step = state->step;
  return result;
}

}  // namespace tally
