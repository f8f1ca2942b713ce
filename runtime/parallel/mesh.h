// Mesh: the named parallel dimensions of a tally deployment and this rank's
// coordinates in them.
//
// The world is laid out row-major as pp x dp_replicate x dp_shard x cp x tp
// (tp fastest, so tensor-parallel peers are neighbours). ep is not a separate
// factor of the world: expert-parallel groups are carved out of the
// data-parallel ranks (dp_shard x cp).
//
//   tally::MeshShape shape;  // every size 1: the single-rank server
//   shape.tp = 2; shape.dp_shard = 2;
//   TALLY_ASSIGN_OR_RETURN(tally::Mesh mesh, tally::Mesh::Create(shape, rank));
//   int tp_rank = mesh.coord(tally::MeshDim::kTp);
#ifndef TALLY_RUNTIME_PARALLEL_MESH_H_
#define TALLY_RUNTIME_PARALLEL_MESH_H_

#include <array>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tally {

enum class MeshDim { kPp = 0, kDpReplicate, kDpShard, kCp, kTp, kEp };
inline constexpr int kNumMeshDims = 6;
// The dims whose product is the world size, outermost first.
inline constexpr std::array<MeshDim, 5> kWorldDims = {
    MeshDim::kPp, MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kCp,
    MeshDim::kTp};

const char* MeshDimName(MeshDim dim);  // "dp_shard"

struct MeshShape {
  int pp = 1;
  int dp_replicate = 1;
  int dp_shard = 1;
  int cp = 1;
  int tp = 1;
  int ep = 1;

  int size(MeshDim dim) const;
  int world_size() const { return pp * dp_replicate * dp_shard * cp * tp; }
  std::string ToString() const;  // "pp=1 dp_replicate=1 ..."
};

class Mesh {
 public:
  // INVALID_ARGUMENT for a size < 1, ep not dividing dp_shard * cp, or a rank
  // outside the world.
  static absl::StatusOr<Mesh> Create(const MeshShape& shape, int rank);
  static Mesh SingleRank();

  const MeshShape& shape() const { return shape_; }
  int rank() const { return rank_; }
  int world_size() const { return shape_.world_size(); }
  int size(MeshDim dim) const { return shape_.size(dim); }
  int coord(MeshDim dim) const { return coords_[static_cast<int>(dim)]; }
  // This rank's block of ep peers within dp_shard x cp: ranks holding the
  // same experts differ in it (or in dp_replicate).
  int expert_replica_coord() const {
    return (coord(MeshDim::kDpShard) * shape_.cp + coord(MeshDim::kCp)) /
           shape_.ep;
  }

  // The ranks that differ from this one only along the world dims `dims`
  // (this rank included), in row-major order.
  std::vector<int> GroupRanks(const std::vector<MeshDim>& dims) const;
  // The ep group: the ranks of this rank's ep block (same pp, dp_replicate,
  // tp and expert_replica_coord), in ep order.
  std::vector<int> ExpertParallelRanks() const;
  // The expert-data-parallel group: the ranks holding this rank's experts
  // with different data (same pp, tp and ep coord; any dp_replicate and
  // expert_replica_coord), in rank order.
  std::vector<int> ExpertDataParallelRanks() const;

 private:
  Mesh(const MeshShape& shape, int rank);

  MeshShape shape_;
  int rank_ = 0;
  std::array<int, kNumMeshDims> coords_{};
};

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_MESH_H_
