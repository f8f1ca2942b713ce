// EngineTestPeer: what tests and benchmarks reach inside an Engine beyond its
// public API: a model's parameters and optimizer to inspect or change, its
// BuiltModel, and the options they vary between calls in one set of rank
// processes. Header-only; production code never includes it.
//
//   TALLY_ASSIGN_OR_RETURN(tally::CausalLm * model,
//                          tally::EngineTestPeer::Model(*engine, "m"));
//   tally::EngineTestPeer::SetZeroStage(*engine, tally::ZeroStage::kGradients);
#ifndef TALLY_TESTS_TESTING_ENGINE_TEST_PEER_H_
#define TALLY_TESTS_TESTING_ENGINE_TEST_PEER_H_

#include <string>

#include "absl/status/statusor.h"
#include "base/status.h"
#include "runtime/config/types.h"
#include "runtime/engine/built_model.h"
#include "runtime/engine/engine.h"
#include "runtime/model/causal_lm.h"
#include "runtime/train/optimizer.h"

namespace tally {

class EngineTestPeer {
 public:
  static absl::StatusOr<BuiltModel*> Built(Engine& engine,
                                           const std::string& model_id) {
    TALLY_ASSIGN_OR_RETURN(Engine::ModelState * state, engine.Find(model_id));
    return state->built.get();
  }
  static absl::StatusOr<CausalLm*> Model(Engine& engine,
                                         const std::string& model_id) {
    TALLY_ASSIGN_OR_RETURN(BuiltModel * built, Built(engine, model_id));
    return &built->model();
  }
  static absl::StatusOr<Optimizer*> OptimizerOf(Engine& engine,
                                                const std::string& model_id) {
    TALLY_ASSIGN_OR_RETURN(BuiltModel * built, Built(engine, model_id));
    return &built->optimizer();
  }
  // EngineOptions::zero_stage of the models created from now on (a model
  // keeps the stage it was built with), so that tests and benchmarks compare
  // stages in one set of rank processes; every rank must do the same.
  static void SetZeroStage(Engine& engine, ZeroStage stage) {
    engine.options_.zero_stage = stage;
  }
  // EngineOptions::overlap_grad_sync from the next call on. Results do not
  // depend on it, so benchmarks may alternate it between calls.
  static void SetOverlapGradSync(Engine& engine, bool on) {
    engine.options_.overlap_grad_sync = on;
  }
};

}  // namespace tally

#endif  // TALLY_TESTS_TESTING_ENGINE_TEST_PEER_H_
