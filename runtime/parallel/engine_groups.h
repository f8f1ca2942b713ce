// EngineGroups: the communicators of one rank, by the role they play in the
// training math. The engine forms them once from its ProcessGroups
// (FormEngineGroups; SingleRankGroups for one rank); the units that run
// collectives on a model take them explicitly.
//
//   TALLY_ASSIGN_OR_RETURN(tally::EngineGroups g,
//                          tally::FormEngineGroups(process_groups));
//   if (g.pp->size() > 1) { ... }  // a staged model
//   TALLY_RETURN_IF_ERROR(g.replicas->AllReduce(grad, tally::ReduceOp::kSum));
#ifndef TALLY_RUNTIME_PARALLEL_ENGINE_GROUPS_H_
#define TALLY_RUNTIME_PARALLEL_ENGINE_GROUPS_H_

#include "absl/status/statusor.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/distributed.h"

namespace tally {

// In a single-rank engine every role is the same one-rank group.
struct EngineGroups {
  Communicator* world = nullptr;  // the gradient norm's one collective
  Communicator* data = nullptr;   // ranks holding distinct samples
  // data x cp: ranks holding distinct tokens; per-sample results sum here.
  Communicator* data_and_cp = nullptr;
  // dp_replicate x cp: ranks holding the same parameter shards, each with a
  // partial gradient. Gradients SUM here (EAGER: per call; DEFERRED: at
  // OptimStep).
  Communicator* replicas = nullptr;
  Communicator* dp_replicate = nullptr;
  Communicator* dp_shard = nullptr;  // ZeRO-3 gather / reduce-scatter
  Communicator* cp = nullptr;        // the K/V gather of context parallelism
  Communicator* tp = nullptr;        // Megatron tensor parallelism
  Communicator* ep = nullptr;        // expert parallelism: the dispatch
  // The expert-data-parallel ranks: holding the same experts with different
  // data. Expert gradients SUM here (never over ep), like dense ones over
  // `replicas`.
  Communicator* expert_replicas = nullptr;
  // Pipeline parallelism: the stages of this rank's (dp, cp, tp)
  // coordinates; group rank = stage. Activations and their gradients move
  // here, and the tied embedding's two copies sum their gradients.
  Communicator* pp = nullptr;
};

// Every role's group of this rank, formed over the mesh dimensions it spans
// (a collective on every rank of `groups`, which outlives the result).
absl::StatusOr<EngineGroups> FormEngineGroups(ProcessGroups& groups);
// Every role played by `world`, a one-rank group.
EngineGroups SingleRankGroups(Communicator& world);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_ENGINE_GROUPS_H_
