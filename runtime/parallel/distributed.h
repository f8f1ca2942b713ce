// Distributed start-up: who this rank is (from flags or a launcher's
// environment), the rendezvous of all ranks through a c10d::TCPStore, and the
// process groups of every mesh dimension this rank belongs to: Gloo on the
// CPU, NCCL for a CUDA device (but the control group, always Gloo).
//
// A rank is told its identity by flags, by torchrun / a PyTorchJob (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or by a LeaderWorkerSet
// (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX). ProcessGroups then
// creates every communicator the runtime uses, once, at start-up.
//
//   TALLY_ASSIGN_OR_RETURN(
//       tally::RankEnv env,
//       tally::ResolveRankEnv(overrides, [](const char* name) {
//         const char* value = std::getenv(name);
//         return value ? std::optional<std::string>(value) : std::nullopt;
//       }));
//   TALLY_ASSIGN_OR_RETURN(tally::Mesh mesh,
//                          tally::Mesh::Create(shape, env.rank));
//   TALLY_ASSIGN_OR_RETURN(
//       std::unique_ptr<tally::ProcessGroups> groups,
//       tally::ProcessGroups::Create(env, mesh, absl::Minutes(5)));
//   TALLY_ASSIGN_OR_RETURN(tally::Communicator* dp,
//                          groups->group({tally::MeshDim::kDpReplicate,
//                                         tally::MeshDim::kDpShard}));
//   TALLY_RETURN_IF_ERROR(dp->AllReduce(tokens, tally::ReduceOp::kSum));
//
// A rank that fails on its own while its peers may wait in a collective
// calls FailFast(error); at the end of the command every rank calls
// Recover(status), which agrees on the status and re-forms the groups:
//
//   absl::Status local = ComputeSomething();  // fails on one rank
//   if (!local.ok()) groups->FailFast(local);
//   local = groups->Recover(local);  // the same status on every rank
#ifndef TALLY_RUNTIME_PARALLEL_DISTRIBUTED_H_
#define TALLY_RUNTIME_PARALLEL_DISTRIBUTED_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/mesh.h"

namespace tally {

inline constexpr int kDefaultMasterPort = 29500;

struct RankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = kDefaultMasterPort;
  // GLOO_SOCKET_IFNAME: the network interface Gloo binds to; empty means
  // loopback for a loopback master, else the interface of this host's name.
  std::string gloo_interface;
  // Which source gave rank and world size: "flags", "torchrun", "lws" or
  // "default" (a single rank).
  std::string source = "default";
};

// Values from command-line flags (--rank, --world-size, --local-rank,
// --master-addr, --master-port); each one that is set wins over the
// environment.
struct RankEnvOverrides {
  std::optional<int> rank;
  std::optional<int> world_size;
  std::optional<int> local_rank;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
};

// Returns the environment variable `name`, or nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

// Torchrun's variables win over LeaderWorkerSet's (torchrun may run inside an
// LWS pod and then knows the finer rank); flags win over both. MASTER_PORT
// applies to every source. INVALID_ARGUMENT, starting with the variable's
// name, for a malformed value, a rank outside [0, world size), or a partial
// set (RANK without WORLD_SIZE, an LWS variable without the others).
absl::StatusOr<RankEnv> ResolveRankEnv(const RankEnvOverrides& overrides,
                                       const EnvLookup& lookup);

// Every communicator of this rank. All ranks create the same sequence of
// groups, so none waits on a group another rank will not form.
class ProcessGroups {
 public:
  // Rendezvous at env.master_addr:master_port (rank 0 runs the store there)
  // and create the groups; all of it must finish within `rendezvous_timeout`
  // (DEADLINE_EXCEEDED otherwise). Connecting to the master is retried with
  // backoff because rank 0, or its DNS name, may come up late. A world of one
  // rank needs no store: its groups are local single-rank communicators.
  // INVALID_ARGUMENT when `env` and `mesh` disagree on rank or world size.
  // Every collective fails after `collective_timeout`, except the control
  // group's on ranks > 0, which wait for rank 0's next command indefinitely.
  // With a CUDA `device` every group but control() is an NCCL communicator
  // (MakeCudaCommunicator) on device.index() (0 when it has none) over the
  // same store; control() stays Gloo on the CPU for the command plane. A
  // device CheckCommunicatorDevice refuses is refused before the rendezvous.
  static absl::StatusOr<std::unique_ptr<ProcessGroups>> Create(
      const RankEnv& env, const Mesh& mesh, absl::Duration rendezvous_timeout,
      absl::Duration collective_timeout = kDefaultCollectiveTimeout,
      torch::Device device = torch::kCPU);

  ProcessGroups(const ProcessGroups&) = delete;
  ProcessGroups& operator=(const ProcessGroups&) = delete;
  ~ProcessGroups();

  Communicator& world() { return *world_; }
  // Every rank, like world(), but reserved for broadcasting commands so their
  // traffic and counters never mix with the training collectives.
  Communicator& control() { return *control_; }

  // The world dims of every group Create forms besides world, control and
  // the expert groups, in creation order: each single world dim,
  // {dp_replicate, dp_shard}, {dp_replicate, dp_shard, cp}, {dp_shard, cp}
  // and {dp_replicate, cp}.
  static const std::vector<std::vector<MeshDim>>& CreatedGroupDims();

  // The group spanning the world dims `dims` (any order) that holds this
  // rank, one of CreatedGroupDims(); FAILED_PRECONDITION for any other
  // combination, INVALID_ARGUMENT for ep or a repeated dim.
  absl::StatusOr<Communicator*> group(std::vector<MeshDim> dims);

  // Expert parallelism (Mesh::ExpertParallelRanks): the ranks splitting the
  // experts. A one-rank group when ep = 1.
  Communicator& expert_parallel() { return *expert_parallel_; }
  // The ranks holding the same experts with different data
  // (Mesh::ExpertDataParallelRanks): expert gradients sum here. When ep = 1
  // it is the {dp_replicate, dp_shard, cp} group.
  Communicator& expert_data_parallel() { return *expert_data_parallel_; }

  // The first collective failure of any group (Communicator::failure).
  absl::Status failure() const;

  // This rank failed on its own (`why`) between two collectives while its
  // peers may wait in the next one: marks the failure in the store as a live
  // rank's and closes every connection of every group but control(), so
  // that each peer's collective fails at once. A peer whose collective fails
  // closes its own groups in turn, so every rank's groups fail within
  // moments, wherever it waits. Nothing (the failure is only this rank's)
  // in a world of one rank, on CUDA (NCCL groups are not re-formed) or once
  // a group failed already.
  void FailFast(const absl::Status& why);

  // At the end of a command, on every rank, with the command's `local`
  // status: `local` unchanged while no group failed. When the groups failed
  // because a rank called FailFast, every rank agrees on the status over
  // control() (AgreeOnStatus: the failing rank's own status, which the others
  // quote naming it) and the ranks re-form every group but control() under
  // a fresh store prefix: the same Communicator objects go on with new c10d
  // groups (Communicator::Rejoin), and failure() is OK again. A failure no
  // rank announced (a dead or hung rank, a timeout) returns `local` (or the
  // failure when `local` is OK) with the groups left failed, as does an
  // agreement or a re-forming that fails.
  absl::Status Recover(absl::Status local);

  // How many times the groups were re-formed.
  int generation() const { return generation_; }

 private:
  ProcessGroups() = default;

  // Forms (generation 0) or re-forms every group but control() under
  // `prefix` in the store.
  absl::Status FormDataGroups(const std::string& prefix, absl::Time deadline);
  // Every group but control().
  std::vector<Communicator*> DataGroups() const;
  // FailFast can announce a failure and Recover re-form the groups: a store
  // (more than one rank) and Gloo groups.
  bool Recoverable() const;
  // Fails and closes every group but control(), once.
  void CloseDataGroups(const absl::Status& why);
  // A rank called FailFast since the groups were last formed.
  bool FailedFastByARank();
  absl::Status DataFailure() const;

  // Declared first so the groups using it are destroyed before it.
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<gloo::transport::Device> gloo_device_;
  std::optional<Mesh> mesh_;
  absl::Duration collective_timeout_;
  torch::Device device_ = torch::kCPU;
  int generation_ = 0;
  std::atomic<bool> closing_{false};
  // What this rank's FailFast announced since the groups were last formed.
  absl::Status failed_fast_;
  std::unique_ptr<Communicator> world_;
  std::unique_ptr<Communicator> control_;
  std::vector<std::pair<std::vector<MeshDim>, std::unique_ptr<Communicator>>>
      groups_;
  std::unique_ptr<Communicator> expert_parallel_;
  // Owned only when ep > 1; else a group of groups_.
  std::unique_ptr<Communicator> owned_expert_data_parallel_;
  Communicator* expert_data_parallel_ = nullptr;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_DISTRIBUTED_H_
