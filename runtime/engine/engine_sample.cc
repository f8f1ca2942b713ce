// Engine::Sample and Engine::ComputeLogprobs: the model's weights after its
// last OptimStep, or a sampler snapshot's (engine_sampler.cc), read without
// gradients (sample_call.h), on every rank of the mesh
// (runtime/sample/decode.h: the data ranks split the sequences).
#include "base/status.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/sample_call.h"

namespace tally {
namespace {

// The groups a decode needs beside the model's own (decode_types.h); the
// world agrees on stopping a cancelled call.
DecodeGroups DecodeGroupsOf(const EngineGroups& groups) {
  return DecodeGroups{groups.data_and_cp, groups.pp, groups.world};
}

}  // namespace

absl::StatusOr<SampleCallResult> Engine::Sample(const std::string& model_id,
                                                SampleArgs args,
                                                const std::string& sampler) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  int64_t step = 0;
  TALLY_ASSIGN_OR_RETURN(const std::unique_ptr<SwappedInWeights> weights,
                         WeightsToSample(*state, sampler, &step));
  // Every rank must draw with one seed: rank 0's, when the call names none
  // (the server draws it before replicating the request; a direct caller
  // may not).
  if (!args.seed.has_value() && mesh_.world_size() > 1) {
    torch::Tensor seed = torch::full(
        {1}, static_cast<int64_t>(DrawSeed()),
        torch::TensorOptions().dtype(torch::kInt64).device(device()));
    TALLY_RETURN_IF_ERROR(world().Broadcast(seed, 0));
    args.seed = static_cast<uint64_t>(seed.item<int64_t>());
  }
  // No window check: sampling reads the weights, not the gradients, so a
  // pending window is neither blocked nor touched.
  TALLY_ASSIGN_OR_RETURN(
      SampleCallResult result,
      RunSampleCall(state->built->model(), args, state->eos_token_ids,
                    DecodeGroupsOf(groups_)));
  result.step = step;
  return result;
}

absl::StatusOr<LogprobsCallResult> Engine::ComputeLogprobs(
    const std::string& model_id, const LogprobsArgs& args,
    const std::string& sampler) {
  TALLY_ASSIGN_OR_RETURN(ModelState * state, Find(model_id));
  int64_t step = 0;
  TALLY_ASSIGN_OR_RETURN(const std::unique_ptr<SwappedInWeights> weights,
                         WeightsToSample(*state, sampler, &step));
  TALLY_ASSIGN_OR_RETURN(
      LogprobsCallResult result,
      RunLogprobsCall(state->built->model(), args, DecodeGroupsOf(groups_)));
  result.step = step;
  return result;
}

}  // namespace tally
