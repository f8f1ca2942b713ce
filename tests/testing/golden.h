// Helpers of the golden tests, which train the same model on a mesh engine
// (one per rank process, see multirank.h) and on a single-device reference
// engine in the same process, and compare what each rank holds.
//
//   TALLY_ASSIGN_OR_RETURN(auto engine,
//                          tally::testing::CreateRankEngine(shape, env, {}));
//   ... the same calls on engine and reference ...
//   tally::testing::ExpectGradientShards(model, ref_model, 1e-10);
//   tally::testing::ExpectSameStep(got, want, args, 1e-10);
#ifndef TALLY_TESTS_TESTING_GOLDEN_H_
#define TALLY_TESTS_TESTING_GOLDEN_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/mesh.h"

namespace tally::testing {

// This rank's engine of a deployment laid out as `shape`; with a CUDA
// options.device, on GPU env.local_rank.
absl::StatusOr<std::unique_ptr<Engine>> CreateRankEngine(
    const MeshShape& shape, const RankEnv& env, const EngineOptions& options);

// The body of a golden test on one rank: that rank's engine of the mesh and
// a single-device reference engine in the same process.
using GoldenBody = std::function<absl::Status(Engine& engine, Engine& reference,
                                              const RankEnv& env)>;

// Runs `body` on every rank of `shape` (RunOnRanks), with the rank's engine
// built with `options` and the reference with `reference_options`.
void RunGoldenOnRanks(const MeshShape& shape, const EngineOptions& options,
                      const EngineOptions& reference_options,
                      const GoldenBody& body);

// One ForwardBackward on the mesh (`got`) and the reference (`want`): the
// same counts (call, samples, window) and losses within `tolerance`, the
// call's and every sample's; per-token log-probabilities too when returned.
void ExpectSameCall(const ForwardBackwardResult& got,
                    const ForwardBackwardResult& want, double tolerance);

// Every trainable parameter of `model` has a gradient, finite and within
// `tolerance` (relative) of this rank's shard of `reference`'s; frozen ones
// have none in either.
void ExpectGradientShards(CausalLm& model, CausalLm& reference,
                          double tolerance);

// One OptimStep on the mesh (`got`) and the reference (`want`) with `args`:
// neither skipped, the same step and normalizer, a positive norm and the
// clip coefficient within `tolerance`; clipping (< 1) exactly when
// args.max_grad_norm > 0.
void ExpectSameStep(const OptimStepResult& got, const OptimStepResult& want,
                    const OptimStepArgs& args, double tolerance);

}  // namespace tally::testing

#endif  // TALLY_TESTS_TESTING_GOLDEN_H_
