// Placement: how one parameter is laid out along each mesh dimension, the
// DTensor idea reduced to what tally needs: Shard(dim) or Replicate.
//
// The gradient norm counts a parameter's local shard only on its canonical
// replica, the rank whose coordinate is 0 along every mesh dim where the
// parameter is Replicate; so replicas are never double counted and shards
// are each counted once. A parameter Shard over ep (an expert) is counted in
// the first ep block of dp_shard x cp (Mesh::expert_replica_coord() == 0).
//
//   tally::Placements p;                       // replicated everywhere
//   p.Set(tally::MeshDim::kTp, tally::Placement::Shard(0));
//   bool counts = p.IsCanonicalReplica(mesh);
#ifndef TALLY_RUNTIME_PARALLEL_PLACEMENT_H_
#define TALLY_RUNTIME_PARALLEL_PLACEMENT_H_

#include <array>
#include <string>

#include "runtime/parallel/mesh.h"

namespace tally {

class Placement {
 public:
  static Placement Replicate() { return Placement(-1); }
  static Placement Shard(int dim) { return Placement(dim); }

  bool is_shard() const { return shard_dim_ >= 0; }
  int shard_dim() const { return shard_dim_; }
  std::string ToString() const;  // "Replicate" or "Shard(0)"
  bool operator==(const Placement& o) const {
    return shard_dim_ == o.shard_dim_;
  }

 private:
  explicit Placement(int shard_dim) : shard_dim_(shard_dim) {}
  int shard_dim_;
};

class Placements {
 public:
  Placements() { placements_.fill(Placement::Replicate()); }

  Placements& Set(MeshDim dim, Placement placement) {
    placements_[static_cast<int>(dim)] = placement;
    return *this;
  }
  const Placement& at(MeshDim dim) const {
    return placements_[static_cast<int>(dim)];
  }

  // True when this rank holds the copy of its shard that the norm counts.
  bool IsCanonicalReplica(const Mesh& mesh) const;

 private:
  std::array<Placement, kNumMeshDims> placements_{
      Placement::Replicate(), Placement::Replicate(), Placement::Replicate(),
      Placement::Replicate(), Placement::Replicate(), Placement::Replicate()};
};

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_PLACEMENT_H_
