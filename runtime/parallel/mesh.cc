#include "runtime/parallel/mesh.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tally {

const char* MeshDimName(MeshDim dim) {
  switch (dim) {
    case MeshDim::kPp:
      return "pp";
    case MeshDim::kDpReplicate:
      return "dp_replicate";
    case MeshDim::kDpShard:
      return "dp_shard";
    case MeshDim::kCp:
      return "cp";
    case MeshDim::kTp:
      return "tp";
    case MeshDim::kEp:
      return "ep";
  }
  return "unknown";
}

int MeshShape::size(MeshDim dim) const {
  switch (dim) {
    case MeshDim::kPp:
      return pp;
    case MeshDim::kDpReplicate:
      return dp_replicate;
    case MeshDim::kDpShard:
      return dp_shard;
    case MeshDim::kCp:
      return cp;
    case MeshDim::kTp:
      return tp;
    case MeshDim::kEp:
      return ep;
  }
  return 1;
}

std::string MeshShape::ToString() const {
  return absl::StrCat("pp=", pp, " dp_replicate=", dp_replicate,
                      " dp_shard=", dp_shard, " cp=", cp, " tp=", tp,
                      " ep=", ep);
}

absl::StatusOr<Mesh> Mesh::Create(const MeshShape& shape, int rank) {
  for (MeshDim dim : {MeshDim::kPp, MeshDim::kDpReplicate, MeshDim::kDpShard,
                      MeshDim::kCp, MeshDim::kTp, MeshDim::kEp}) {
    if (shape.size(dim) < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh.", MeshDimName(dim), " must be >= 1, got ", shape.size(dim)));
    }
  }
  if ((shape.dp_shard * shape.cp) % shape.ep != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh.ep (", shape.ep, ") must divide dp_shard * cp (",
                     shape.dp_shard * shape.cp, ")"));
  }
  if (rank < 0 || rank >= shape.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " outside a world of ", shape.world_size()));
  }
  return Mesh(shape, rank);
}

Mesh Mesh::SingleRank() { return Mesh(MeshShape{}, 0); }

Mesh::Mesh(const MeshShape& shape, int rank) : shape_(shape), rank_(rank) {
  int rest = rank;
  for (auto it = kWorldDims.rbegin(); it != kWorldDims.rend(); ++it) {
    int size = shape.size(*it);
    coords_[static_cast<int>(*it)] = rest % size;
    rest /= size;
  }
  // ep ranks are the fastest-varying part of the dp_shard x cp block.
  int data_coord = coord(MeshDim::kDpShard) * shape.cp + coord(MeshDim::kCp);
  coords_[static_cast<int>(MeshDim::kEp)] = data_coord % shape.ep;
}

std::vector<int> Mesh::GroupRanks(const std::vector<MeshDim>& dims) const {
  std::vector<int> ranks = {0};
  // Build the group in row-major order of the world dims it spans.
  std::vector<int> strides(kNumMeshDims, 0);
  int stride = 1;
  for (auto it = kWorldDims.rbegin(); it != kWorldDims.rend(); ++it) {
    strides[static_cast<int>(*it)] = stride;
    stride *= shape_.size(*it);
  }
  int base = rank_;
  for (MeshDim dim : dims) {
    base -= coord(dim) * strides[static_cast<int>(dim)];
  }
  ranks[0] = base;
  for (MeshDim dim : kWorldDims) {
    bool in_group = false;
    for (MeshDim d : dims) in_group |= (d == dim);
    if (!in_group) continue;
    std::vector<int> expanded;
    for (int r : ranks) {
      for (int c = 0; c < shape_.size(dim); ++c) {
        expanded.push_back(r + c * strides[static_cast<int>(dim)]);
      }
    }
    ranks = std::move(expanded);
  }
  return ranks;
}

std::vector<int> Mesh::ExpertParallelRanks() const {
  std::vector<int> ranks;
  for (int r : GroupRanks({MeshDim::kDpShard, MeshDim::kCp})) {
    const Mesh peer(shape_, r);
    if (peer.expert_replica_coord() == expert_replica_coord()) {
      ranks.push_back(r);
    }
  }
  return ranks;
}

std::vector<int> Mesh::ExpertDataParallelRanks() const {
  std::vector<int> ranks;
  for (int r :
       GroupRanks({MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kCp})) {
    if (Mesh(shape_, r).coord(MeshDim::kEp) == coord(MeshDim::kEp)) {
      ranks.push_back(r);
    }
  }
  return ranks;
}

}  // namespace tally
