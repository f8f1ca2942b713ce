// Global gradient norm over every parallel dimension with one collective.
//
// Each rank measures the local shards of the parameters it holds the
// canonical replica of (see placement.h), dense and expert parameters in
// separate slots, and a single all-reduce over the world (SUM of squares for
// L2, MAX for INF) gives every rank the same global value. Summing squares
// over shards and never over replicas is exactly what the staged reduction
// (sum over tp and dp_shard, nothing over dp_replicate, experts over ep,
// everything over pp) computes, in one step instead of several.
//
//   TALLY_ASSIGN_OR_RETURN(tally::GradNorm norm,
//       tally::ComputeGlobalGradNorm(model.parameters(), mesh, world,
//                                    tally::NormType::kL2));
//   if (!std::isfinite(norm.total)) ...
#ifndef TALLY_RUNTIME_PARALLEL_GRAD_NORM_H_
#define TALLY_RUNTIME_PARALLEL_GRAD_NORM_H_

#include <vector>

#include "absl/status/statusor.h"
#include "runtime/config/types.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/mesh.h"
#include "runtime/parallel/parameter.h"

namespace tally {

struct GradNorm {
  double total =
      0.0;  // NaN if any gradient element is NaN, else Inf if any is Inf
  double dense = 0.0;
  double expert = 0.0;
};

// Norm of the current `.grad` of `parameters` (an undefined grad counts as
// zero). Issues exactly one all-reduce on `world`.
absl::StatusOr<GradNorm> ComputeGlobalGradNorm(
    const std::vector<Parameter>& parameters, const Mesh& mesh,
    Communicator& world, NormType type);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_GRAD_NORM_H_
