#include "runtime/placement.h"

#include "absl/strings/str_cat.h"

namespace tally {

std::string Placement::ToString() const {
  return is_shard() ? absl::StrCat("Shard(", shard_dim_, ")") : "Replicate";
}

bool Placements::IsCanonicalReplica(const Mesh& mesh) const {
  for (int d = 0; d < kNumMeshDims; ++d) {
    MeshDim dim = static_cast<MeshDim>(d);
    // ep is carved out of dp_shard x cp, whose placements already decide
    // which copies count.
    if (dim == MeshDim::kEp) continue;
    if (!placements_[d].is_shard() && mesh.coord(dim) != 0) return false;
  }
  return true;
}

}  // namespace tally
