#include "runtime/parallel/engine_groups.h"

#include "base/status.h"
#include "runtime/parallel/mesh.h"

namespace tally {

absl::StatusOr<EngineGroups> FormEngineGroups(ProcessGroups& groups) {
  EngineGroups g;
  g.world = &groups.world();
  TALLY_ASSIGN_OR_RETURN(
      g.data, groups.group({MeshDim::kDpReplicate, MeshDim::kDpShard}));
  TALLY_ASSIGN_OR_RETURN(
      g.data_and_cp,
      groups.group({MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kCp}));
  TALLY_ASSIGN_OR_RETURN(g.replicas,
                         groups.group({MeshDim::kDpReplicate, MeshDim::kCp}));
  TALLY_ASSIGN_OR_RETURN(g.dp_replicate, groups.group({MeshDim::kDpReplicate}));
  TALLY_ASSIGN_OR_RETURN(g.dp_shard, groups.group({MeshDim::kDpShard}));
  TALLY_ASSIGN_OR_RETURN(g.cp, groups.group({MeshDim::kCp}));
  TALLY_ASSIGN_OR_RETURN(g.tp, groups.group({MeshDim::kTp}));
  g.ep = &groups.expert_parallel();
  g.expert_replicas = &groups.expert_data_parallel();
  TALLY_ASSIGN_OR_RETURN(g.pp, groups.group({MeshDim::kPp}));
  return g;
}

EngineGroups SingleRankGroups(Communicator& world) {
  Communicator* w = &world;
  return {w, w, w, w, w, w, w, w, w, w, w};
}

}  // namespace tally
