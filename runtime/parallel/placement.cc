#include "runtime/parallel/placement.h"

#include "absl/strings/str_cat.h"

namespace tally {

std::string Placement::ToString() const {
  return is_shard() ? absl::StrCat("Shard(", shard_dim_, ")") : "Replicate";
}

bool Placements::IsCanonicalReplica(const Mesh& mesh) const {
  // ep is carved out of dp_shard x cp. A parameter sharded over ep has its
  // copies in the other ep blocks of dp_shard x cp; otherwise the dp_shard
  // and cp placements decide which copies count.
  const bool ep_sharded = at(MeshDim::kEp).is_shard();
  if (ep_sharded && mesh.expert_replica_coord() != 0) return false;
  for (int d = 0; d < kNumMeshDims; ++d) {
    MeshDim dim = static_cast<MeshDim>(d);
    if (dim == MeshDim::kEp) continue;
    if (ep_sharded && (dim == MeshDim::kDpShard || dim == MeshDim::kCp)) {
      continue;
    }
    if (!placements_[d].is_shard() && mesh.coord(dim) != 0) return false;
  }
  return true;
}

}  // namespace tally
