#include "runtime/parallel/distributed.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "base/status.h"
#include "runtime/config/address.h"

namespace tally {
namespace {

// A value together with the variable or flag it came from, for errors.
struct Sourced {
  int value;
  const char* name;
};

absl::StatusOr<int> ParseInt(const char* name, const std::string& text) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": must be an integer, got '", text, "'"));
  }
  return value;
}

absl::Status MissingFromSet(const char* missing, const char* present,
                            const char* launcher) {
  return absl::InvalidArgumentError(absl::StrCat(missing, ": not set while ",
                                                 present, " is (", launcher,
                                                 " sets them together)"));
}

std::string DimsName(const std::vector<MeshDim>& dims) {
  return absl::StrJoin(dims, "+", [](std::string* out, MeshDim dim) {
    out->append(MeshDimName(dim));
  });
}

std::chrono::milliseconds ToChrono(absl::Duration duration) {
  return std::chrono::milliseconds(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(duration)));
}

constexpr absl::Duration kFirstBackoff = absl::Milliseconds(100);
constexpr absl::Duration kMaxBackoff = absl::Seconds(2);

// Rank 0 hosts the store; every rank connects a client to it. Failures are
// retried until `deadline`: the master pod, or its DNS record, may appear
// tens of seconds after the other ranks start.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(
    const RankEnv& env, absl::Time deadline) {
  const bool is_server = env.rank == 0;
  // The server listens on every interface, so rank 0 reaches it over
  // loopback and never waits for its own DNS name.
  const std::string host = is_server ? "127.0.0.1" : env.master_addr;
  const std::string master =
      absl::StrCat(env.master_addr, ":", env.master_port);
  absl::Duration backoff = kFirstBackoff;
  absl::Status last_error;
  // The last attempt is made at the deadline itself.
  for (int attempt = 1;; ++attempt) {
    const absl::Time start = absl::Now();
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(env.master_port);
    options.isServer = is_server;
    // Creating the world group already waits for every rank.
    options.waitWorkers = false;
    // LibTorch 1.13 truncates the connect timeout to whole seconds (under 1 s
    // never even tries) and retries once a second within it: 1 s is a single
    // try, and this loop owns the backoff and the logging.
    options.timeout = std::chrono::seconds(1);
    absl::StatusOr<c10::intrusive_ptr<c10d::Store>> store = CatchTorch(
        is_server ? "starting the rendezvous store" : "connecting to master",
        [&]() -> absl::StatusOr<c10::intrusive_ptr<c10d::Store>> {
          return c10::intrusive_ptr<c10d::Store>(
              c10::make_intrusive<c10d::TCPStore>(host, options));
        });
    if (store.ok()) {
      // Gloo's rendezvous waits on store keys for the store's timeout: give
      // it what is left of the budget.
      (*store)->setTimeout(ToChrono(deadline - absl::Now()));
      if (attempt > 1) {
        Log(LogLevel::kInfo, absl::StrCat("rendezvous: reached master ", master,
                                          " on attempt ", attempt));
      }
      return store;
    }
    last_error = store.status();
    if (absl::Now() >= deadline) break;
    const absl::Duration wait =
        std::min(start + backoff, deadline) - absl::Now();
    Log(LogLevel::kWarning,
        absl::StrCat(
            "rendezvous: attempt ", attempt, " at master ", master,
            " failed: ", last_error.message(), "; retrying in ",
            absl::FormatDuration(std::max(wait, absl::ZeroDuration()))));
    absl::SleepFor(wait);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "rendezvous: master ", master, " not reached within the rendezvous ",
      "timeout; last error: ", last_error.message()));
}

// Loopback masters mean a single-host world, so Gloo stays on loopback.
// Otherwise the interface that this host's name resolves to (what
// createDefaultDevice picks; a Kubernetes pod's name resolves to its pod IP),
// unless GLOO_SOCKET_IFNAME names one.
absl::StatusOr<std::shared_ptr<gloo::transport::Device>> MakeGlooDevice(
    const RankEnv& env) {
  return CatchTorch(
      "creating the gloo device",
      [&]() -> absl::StatusOr<std::shared_ptr<gloo::transport::Device>> {
        if (!env.gloo_interface.empty()) {
          return c10d::ProcessGroupGloo::createDeviceForInterface(
              env.gloo_interface);
        }
        if (IsLoopbackHost(env.master_addr)) {
          return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
        }
        return c10d::ProcessGroupGloo::createDefaultDevice();
      });
}

// Ranks > 0 wait on the control group for rank 0's next command, and a server
// may sit idle for days: effectively never time out (ten years; Gloo adds the
// timeout to the current time, so "max" would overflow).
constexpr absl::Duration kControlTimeout = absl::Hours(24 * 365 * 10);

// What every group of this rank is made from.
struct GroupContext {
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<gloo::transport::Device> gloo_device;
  int rank = 0;
  absl::Time deadline;
  torch::Device device = torch::kCPU;
};

// A Gloo group of `ranks` (this rank among them, more than one) under the
// store prefix `name`.
absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooGroup(
    const GroupContext& context, const std::string& name, int group_rank,
    int group_size, std::chrono::milliseconds op_timeout) {
  return CatchTorch(
      "creating a gloo group",
      [&]() -> absl::StatusOr<std::unique_ptr<Communicator>> {
        auto group = MakeAbortableGlooGroup(
            c10::make_intrusive<c10d::PrefixStore>(name, context.store),
            group_rank, group_size, context.gloo_device, op_timeout);
        // Constructing a Gloo group is no synchronization point: a rank may
        // start connecting the next group while a peer still handshakes this
        // one on the same device. The barrier finishes every pair of this
        // group first, so groups connect one at a time.
        group->barrier()->wait();
        return MakeProcessGroupCommunicator(group);
      });
}

// The group of `ranks` (this rank among them) under its own key prefix, so
// groups never read each other's rendezvous keys: on `device` (Gloo on the
// CPU, NCCL on CUDA), or Gloo when `gloo` whatever the device.
absl::StatusOr<std::unique_ptr<Communicator>> MakeGroup(
    const GroupContext& context, const std::string& name,
    const std::vector<int>& ranks, absl::Duration op_timeout, bool gloo) {
  const torch::Device device =
      gloo ? torch::Device(torch::kCPU) : context.device;
  if (ranks.size() == 1) return MakeSingleRankCommunicator(device);
  const int group_rank = static_cast<int>(
      std::find(ranks.begin(), ranks.end(), context.rank) - ranks.begin());
  const int group_size = static_cast<int>(ranks.size());
  absl::StatusOr<std::unique_ptr<Communicator>> group =
      device.is_cuda()
          ? MakeCudaCommunicator(
                context.store, absl::StrCat("nccl/", name), group_rank,
                group_size, device.has_index() ? device.index() : 0, op_timeout)
          : MakeGlooGroup(context, name, group_rank, group_size,
                          std::chrono::milliseconds(
                              absl::ToInt64Milliseconds(op_timeout)));
  if (group.ok()) return group;
  const std::string what = absl::StrCat("rendezvous: group ", name, " (ranks ",
                                        absl::StrJoin(ranks, ","), ")");
  if (absl::Now() >= context.deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, " not formed within the rendezvous timeout: ",
                     group.status().message()));
  }
  return absl::Status(group.status().code(),
                      absl::StrCat(what, ": ", group.status().message()));
}

}  // namespace

const std::vector<std::vector<MeshDim>>& ProcessGroups::CreatedGroupDims() {
  static const auto* dims = new std::vector<std::vector<MeshDim>>{
      {MeshDim::kPp},
      {MeshDim::kDpReplicate},
      {MeshDim::kDpShard},
      {MeshDim::kCp},
      {MeshDim::kTp},
      {MeshDim::kDpReplicate, MeshDim::kDpShard},
      {MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kCp},
      {MeshDim::kDpShard, MeshDim::kCp},
      {MeshDim::kDpReplicate, MeshDim::kCp},
  };
  return *dims;
}

absl::StatusOr<RankEnv> ResolveRankEnv(const RankEnvOverrides& overrides,
                                       const EnvLookup& lookup) {
  RankEnv env;
  Sourced rank{0, "RANK"};
  Sourced world_size{1, "WORLD_SIZE"};
  Sourced local_rank{0, "LOCAL_RANK"};
  Sourced master_port{kDefaultMasterPort, "MASTER_PORT"};
  const char* master_addr_name = "MASTER_ADDR";
  if (auto addr = lookup("MASTER_ADDR")) env.master_addr = *addr;

  const auto torch_rank = lookup("RANK");
  const auto torch_world = lookup("WORLD_SIZE");
  const auto lws_leader = lookup("LWS_LEADER_ADDRESS");
  const auto lws_size = lookup("LWS_GROUP_SIZE");
  const auto lws_index = lookup("LWS_WORKER_INDEX");
  if (torch_rank || torch_world) {
    if (!torch_rank) return MissingFromSet("RANK", "WORLD_SIZE", "torchrun");
    if (!torch_world) return MissingFromSet("WORLD_SIZE", "RANK", "torchrun");
    TALLY_ASSIGN_OR_RETURN(rank.value, ParseInt("RANK", *torch_rank));
    TALLY_ASSIGN_OR_RETURN(world_size.value,
                           ParseInt("WORLD_SIZE", *torch_world));
    if (auto local = lookup("LOCAL_RANK")) {
      TALLY_ASSIGN_OR_RETURN(local_rank.value, ParseInt("LOCAL_RANK", *local));
    }
    env.source = "torchrun";
  } else if (lws_leader || lws_size || lws_index) {
    const char* present = lws_leader ? "LWS_LEADER_ADDRESS"
                          : lws_size ? "LWS_GROUP_SIZE"
                                     : "LWS_WORKER_INDEX";
    constexpr const char* kLws = "a LeaderWorkerSet";
    if (!lws_leader) return MissingFromSet("LWS_LEADER_ADDRESS", present, kLws);
    if (!lws_size) return MissingFromSet("LWS_GROUP_SIZE", present, kLws);
    if (!lws_index) return MissingFromSet("LWS_WORKER_INDEX", present, kLws);
    rank.name = "LWS_WORKER_INDEX";
    world_size.name = "LWS_GROUP_SIZE";
    TALLY_ASSIGN_OR_RETURN(rank.value, ParseInt(rank.name, *lws_index));
    TALLY_ASSIGN_OR_RETURN(world_size.value,
                           ParseInt(world_size.name, *lws_size));
    env.master_addr = *lws_leader;
    master_addr_name = "LWS_LEADER_ADDRESS";
    env.source = "lws";
  }
  if (auto port = lookup("MASTER_PORT")) {
    TALLY_ASSIGN_OR_RETURN(master_port.value, ParseInt("MASTER_PORT", *port));
  }
  if (auto iface = lookup("GLOO_SOCKET_IFNAME")) env.gloo_interface = *iface;

  if (overrides.rank) rank = {*overrides.rank, "--rank"};
  if (overrides.world_size)
    world_size = {*overrides.world_size, "--world-size"};
  if (overrides.rank || overrides.world_size) env.source = "flags";
  if (overrides.local_rank)
    local_rank = {*overrides.local_rank, "--local-rank"};
  if (overrides.master_port) {
    master_port = {*overrides.master_port, "--master-port"};
  }
  if (overrides.master_addr) {
    env.master_addr = *overrides.master_addr;
    master_addr_name = "--master-addr";
  }

  if (world_size.value < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        world_size.name, ": must be >= 1, got ", world_size.value));
  }
  if (rank.value < 0 || rank.value >= world_size.value) {
    return absl::InvalidArgumentError(
        absl::StrCat(rank.name, ": ", rank.value, " is outside [0, ",
                     world_size.name, "=", world_size.value, ")"));
  }
  if (local_rank.value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        local_rank.name, ": must be >= 0, got ", local_rank.value));
  }
  if (master_port.value < 1 || master_port.value > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        master_port.name, ": must be in [1, 65535], got ", master_port.value));
  }
  if (env.master_addr.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(master_addr_name, ": must not be empty"));
  }
  env.rank = rank.value;
  env.world_size = world_size.value;
  env.local_rank = local_rank.value;
  env.master_port = master_port.value;
  return env;
}

absl::StatusOr<std::unique_ptr<ProcessGroups>> ProcessGroups::Create(
    const RankEnv& env, const Mesh& mesh, absl::Duration rendezvous_timeout,
    absl::Duration collective_timeout, torch::Device device) {
  TALLY_RETURN_IF_ERROR(CheckCommunicatorDevice(device));
  if (collective_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the collective timeout must be positive, got ",
                     absl::FormatDuration(collective_timeout)));
  }
  if (env.world_size != mesh.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", env.world_size, " (from ", env.source,
                     ") differs from the mesh's ", mesh.world_size(), " (",
                     mesh.shape().ToString(), ")"));
  }
  if (env.rank != mesh.rank()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", env.rank, " (from ", env.source,
                     ") differs from the mesh's rank ", mesh.rank()));
  }
  Log(LogLevel::kInfo,
      absl::StrCat("rank ", env.rank, " of ", env.world_size, " (local rank ",
                   env.local_rank, ", from ", env.source, "), master ",
                   env.master_addr, ":", env.master_port, ", mesh ",
                   mesh.shape().ToString()));
  const absl::Time deadline = absl::Now() + rendezvous_timeout;
  std::unique_ptr<ProcessGroups> groups(new ProcessGroups());

  groups->mesh_.emplace(mesh);
  groups->collective_timeout_ = collective_timeout;
  groups->device_ = device;
  if (env.world_size > 1) {
    TALLY_ASSIGN_OR_RETURN(groups->store_, ConnectStore(env, deadline));
    TALLY_ASSIGN_OR_RETURN(groups->gloo_device_, MakeGlooDevice(env));
  }
  std::vector<int> everyone(env.world_size);
  std::iota(everyone.begin(), everyone.end(), 0);
  // Rank 0 sends commands and must notice a dead or hung rank; the others
  // wait for the next command, however long the server sits idle.
  TALLY_ASSIGN_OR_RETURN(
      groups->control_,
      MakeGroup(
          {groups->store_, groups->gloo_device_, env.rank, deadline, device},
          "control", everyone,
          env.rank == 0 ? collective_timeout : kControlTimeout,
          /*gloo=*/true));
  TALLY_RETURN_IF_ERROR(groups->FormDataGroups("", deadline));

  if (env.world_size > 1) {
    // A barrier: every rank joined every group. Its traffic is start-up, not
    // the caller's. Rank 0 keeps the store up: FailFast and Recover use it.
    torch::Tensor token = torch::zeros({1});
    TALLY_RETURN_IF_ERROR(groups->world_->AllReduce(token, ReduceOp::kSum));
    groups->world_->stats().Reset();
    Log(LogLevel::kInfo, absl::StrCat("rendezvous: rank ", env.rank,
                                      " joined all process groups"));
  }
  return groups;
}

ProcessGroups::~ProcessGroups() = default;

absl::Status ProcessGroups::FormDataGroups(const std::string& prefix,
                                           absl::Time deadline) {
  const Mesh& mesh = *mesh_;
  const GroupContext context{store_, gloo_device_, mesh.rank(), deadline,
                             device_};
  const bool reform = world_ != nullptr;
  auto form = [&](const std::string& name, const std::vector<int>& ranks,
                  std::unique_ptr<Communicator>& slot) -> absl::Status {
    // A group of one rank waits for no peer and never fails.
    if (reform && ranks.size() == 1) return absl::OkStatus();
    TALLY_ASSIGN_OR_RETURN(
        std::unique_ptr<Communicator> fresh,
        MakeGroup(context, prefix + name, ranks, collective_timeout_,
                  /*gloo=*/false));
    if (reform) return slot->Rejoin(std::move(fresh));
    slot = std::move(fresh);
    slot->SetFailureListener(
        [this](const absl::Status& why) { CloseDataGroups(why); });
    return absl::OkStatus();
  };
  std::vector<int> everyone(mesh.world_size());
  std::iota(everyone.begin(), everyone.end(), 0);
  TALLY_RETURN_IF_ERROR(form("world", everyone, world_));
  const std::vector<std::vector<MeshDim>>& created = CreatedGroupDims();
  if (!reform) {
    for (const std::vector<MeshDim>& dims : created) {
      groups_.emplace_back(dims, nullptr);
    }
  }
  for (auto& [dims, group] : groups_) {
    const std::vector<int> ranks = mesh.GroupRanks(dims);
    // Named by its members, so the name is unique among all ranks' groups.
    TALLY_RETURN_IF_ERROR(
        form(absl::StrCat(DimsName(dims), "/", absl::StrJoin(ranks, ",")),
             ranks, group));
  }
  const std::vector<int> ep_ranks = mesh.ExpertParallelRanks();
  TALLY_RETURN_IF_ERROR(form(absl::StrCat("ep/", absl::StrJoin(ep_ranks, ",")),
                             ep_ranks, expert_parallel_));
  if (mesh.size(MeshDim::kEp) > 1) {
    const std::vector<int> ranks = mesh.ExpertDataParallelRanks();
    TALLY_RETURN_IF_ERROR(
        form(absl::StrCat("expert_dp/", absl::StrJoin(ranks, ",")), ranks,
             owned_expert_data_parallel_));
    expert_data_parallel_ = owned_expert_data_parallel_.get();
  } else if (!reform) {
    TALLY_ASSIGN_OR_RETURN(
        expert_data_parallel_,
        group({MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kCp}));
  }
  return absl::OkStatus();
}

std::vector<Communicator*> ProcessGroups::DataGroups() const {
  std::vector<Communicator*> all = {world_.get()};
  for (const auto& [dims, group] : groups_) all.push_back(group.get());
  for (Communicator* group :
       {expert_parallel_.get(), owned_expert_data_parallel_.get()}) {
    if (group != nullptr) all.push_back(group);
  }
  return all;
}

absl::Status ProcessGroups::DataFailure() const {
  for (const Communicator* group : DataGroups()) {
    if (group != nullptr && !group->failure().ok()) return group->failure();
  }
  return absl::OkStatus();
}

absl::Status ProcessGroups::failure() const {
  if (control_ != nullptr && !control_->failure().ok()) {
    return control_->failure();
  }
  return DataFailure();
}

namespace {

constexpr char kFailedFastKey[] = "tally/failed_fast/";

}  // namespace

bool ProcessGroups::Recoverable() const {
  return store_ != nullptr && !device_.is_cuda();
}

void ProcessGroups::CloseDataGroups(const absl::Status& why) {
  if (closing_.exchange(true)) return;
  const absl::Status closed = absl::AbortedError(
      absl::StrCat("this rank's process groups were closed after a failure: ",
                   why.message()));
  // A group of one rank has no peer to release (and never fails).
  for (Communicator* group : DataGroups()) {
    if (group != nullptr && group->size() > 1) group->CloseConnections(closed);
  }
}

void ProcessGroups::FailFast(const absl::Status& why) {
  if (why.ok() || !Recoverable() || !DataFailure().ok()) return;
  // Before any connection closes: a peer that sees its collective fail
  // finds the mark when it recovers.
  absl::Status marked = CatchTorch("marking the failure", [&] {
    store_->add(absl::StrCat(kFailedFastKey, generation_), 1);
  });
  if (!marked.ok()) {
    Log(LogLevel::kWarning,
        absl::StrCat("rank ", mesh_->rank(),
                     " could not announce its failure: ", marked.message()));
  }
  Log(LogLevel::kWarning,
      absl::StrCat("rank ", mesh_->rank(),
                   " failed between collectives, closing its process groups "
                   "so that its peers stop waiting: ",
                   why.message()));
  failed_fast_ = why;
  CloseDataGroups(why);
}

bool ProcessGroups::FailedFastByARank() {
  absl::StatusOr<int64_t> marks =
      CatchTorch("reading the failure mark", [&]() -> absl::StatusOr<int64_t> {
        return store_->add(absl::StrCat(kFailedFastKey, generation_), 0);
      });
  return marks.ok() && *marks > 0;
}

absl::Status ProcessGroups::Recover(absl::Status local) {
  const absl::Status failed = DataFailure();
  if (failed.ok()) return local;
  if (local.ok()) local = failed;
  if (!Recoverable() || !control_->failure().ok() || !FailedFastByARank()) {
    return local;
  }
  // The ranks that failed on their own tell; the others only heard of it.
  absl::Status agreed = AgreeOnStatus(
      *control_, failed_fast_.ok() ? absl::OkStatus() : local, "this command");
  if (!control_->failure().ok()) return local;
  if (agreed.ok()) agreed = local;
  // The next generation's groups, under keys no earlier group used.
  ++generation_;
  store_->setTimeout(ToChrono(collective_timeout_));
  const absl::Status reformed = FormDataGroups(
      absl::StrCat("gen", generation_, "/"), absl::Now() + collective_timeout_);
  if (!reformed.ok()) {
    return absl::Status(reformed.code(),
                        absl::StrCat(agreed.message(),
                                     "; re-forming the process groups "
                                     "afterwards failed: ",
                                     reformed.message()));
  }
  closing_ = false;
  failed_fast_ = absl::OkStatus();
  Log(LogLevel::kInfo,
      absl::StrCat("rank ", mesh_->rank(),
                   " re-formed its process groups (generation ", generation_,
                   ") after: ", agreed.message()));
  return agreed;
}

absl::StatusOr<Communicator*> ProcessGroups::group(std::vector<MeshDim> dims) {
  std::sort(dims.begin(), dims.end());
  if (std::adjacent_find(dims.begin(), dims.end()) != dims.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("process group dims repeat a dim: ", DimsName(dims)));
  }
  if (std::find(dims.begin(), dims.end(), MeshDim::kEp) != dims.end()) {
    return absl::InvalidArgumentError(
        "ep is not a world dim: expert groups are carved out of dp_shard x cp");
  }
  for (auto& [group_dims, communicator] : groups_) {
    if (group_dims == dims) return communicator.get();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "no process group was created for {", DimsName(dims), "}; created: ",
      absl::StrJoin(CreatedGroupDims(), ", ",
                    [](std::string* out, const std::vector<MeshDim>& d) {
                      out->append(absl::StrCat("{", DimsName(d), "}"));
                    })));
}

}  // namespace tally
