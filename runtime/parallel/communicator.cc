#include "runtime/parallel/communicator.h"

#include <gloo/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>

#include <atomic>
#include <condition_variable>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace tally {

const char* CommOpName(CommOp op) {
  switch (op) {
    case CommOp::kAllReduce:
      return "all_reduce";
    case CommOp::kAllGather:
      return "all_gather";
    case CommOp::kReduceScatter:
      return "reduce_scatter";
    case CommOp::kBroadcast:
      return "broadcast";
    case CommOp::kSend:
      return "send";
    case CommOp::kRecv:
      return "recv";
  }
  return "unknown";
}

void CommStats::Record(CommOp op, int64_t bytes) {
  CommCounter& counter = counters_[static_cast<int>(op)];
  ++counter.calls;
  counter.bytes += bytes;
}

int64_t CommStats::TotalCalls() const {
  int64_t total = 0;
  for (const CommCounter& c : counters_) total += c.calls;
  return total;
}

PendingCollective PendingCollective::Done(absl::Status status) {
  PendingCollective done(nullptr);
  done.status_ = std::move(status);
  return done;
}

absl::Status PendingCollective::Wait() {
  if (!status_) status_ = wait_();
  return *status_;
}

struct Communicator::Waiters {
  std::mutex mu;
  std::condition_variable cv;

  void Wake() {
    // Whoever waits checks its condition under `mu`: taking it once after
    // the change orders this notification after that check or before it.
    { std::lock_guard<std::mutex> lock(mu); }
    cv.notify_all();
  }
};

Communicator::Communicator() : waiters_(std::make_shared<Waiters>()) {}

absl::Status Communicator::AwaitUnlessFailed(
    const c10::intrusive_ptr<c10::ivalue::Future>& done) {
  std::shared_ptr<Waiters> waiters = waiters_;
  done->addCallback([waiters](c10::ivalue::Future&) { waiters->Wake(); });
  absl::Status broken;
  std::unique_lock<std::mutex> lock(waiters->mu);
  waiters->cv.wait(lock, [&] {
    if (done->completed()) return true;
    broken = failure();
    return !broken.ok();
  });
  return done->completed() ? absl::OkStatus() : broken;
}

PendingCollective Communicator::AllReduceAsync(torch::Tensor tensor,
                                               ReduceOp op) {
  return PendingCollective::Done(AllReduce(tensor, op));
}

absl::Status Communicator::failure() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return failure_;
}

absl::Status Communicator::SendRecv(const torch::Tensor& send, int dst,
                                    torch::Tensor& recv, int src) {
  return absl::UnimplementedError(
      "this communicator backend has no concurrent send/recv (pipeline "
      "parallelism needs it)");
}

void Communicator::SetFailureListener(
    std::function<void(const absl::Status&)> listener) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  failure_listener_ = std::move(listener);
}

absl::Status Communicator::Latch(absl::Status result) {
  if (result.ok()) return result;
  std::function<void(const absl::Status&)> listener;
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (!failure_.ok()) return result;
    failure_ = result;
    listener = failure_listener_;
  }
  waiters_->Wake();
  // Outside the lock: the listener may abort this very group.
  if (listener) listener(result);
  return result;
}

void Communicator::ClearFailure() {
  std::lock_guard<std::mutex> lock(failure_mu_);
  failure_ = absl::OkStatus();
}

void Communicator::CloseConnections(const absl::Status& why) {
  Latch(why).IgnoreError();
}

absl::Status Communicator::Rejoin(std::unique_ptr<Communicator> fresh) {
  return absl::UnimplementedError(
      "this communicator backend cannot take a re-formed group");
}

absl::StatusOr<torch::Tensor> Communicator::Latch(
    absl::StatusOr<torch::Tensor> result) {
  Latch(result.status()).IgnoreError();
  return result;
}

namespace {

// The connections (pairs) of a gloo::Context: a protected member, read
// through a pointer to it formed in a class derived from its owner. Only a
// virtual call follows, so nothing links against Gloo itself (a LibTorch may
// keep it inside its own library).
struct GlooContextAccess : gloo::Context {
  static gloo::transport::Context& Transport(gloo::Context& context) {
    return *(context.*&GlooContextAccess::transportContext_);
  }
};

// ProcessGroupGloo with a way to close its connections while peers wait
// in one of its collectives (c10d 1.13 has no abort for Gloo).
class AbortableGlooGroup : public c10d::ProcessGroupGloo {
 public:
  using c10d::ProcessGroupGloo::ProcessGroupGloo;

  // A hard close (TCP reset) of every pair: each peer's pending send or
  // receive on it fails with a connection error.
  void ResetPairs() {
    for (const std::shared_ptr<gloo::Context>& context : contexts_) {
      gloo::transport::Context& transport =
          GlooContextAccess::Transport(*context);
      for (int peer = 0; peer < context->size; ++peer) {
        if (peer == context->rank) continue;
        const std::unique_ptr<gloo::transport::Pair>& pair =
            transport.getPair(peer);
        if (pair) pair->close();
      }
    }
  }
};

// Destroys `group` on a thread of its own: ProcessGroupGloo's destructor
// waits for every collective it still runs, and one abandoned on a failed
// connection ends only at the group's timeout.
void Retire(c10::intrusive_ptr<compat::C10dBackend> group) {
  std::thread([group = std::move(group)]() mutable { group.reset(); }).detach();
}

int64_t Bytes(const torch::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

class ProcessGroupCommunicator : public Communicator {
 public:
  explicit ProcessGroupCommunicator(
      c10::intrusive_ptr<compat::C10dBackend> group)
      : group_(std::move(group)), nccl_(group_->getBackendName() == "nccl") {}

  int rank() const override { return group_->getRank(); }
  int size() const override { return group_->getSize(); }

  void CloseConnections(const absl::Status& why) override {
    Communicator::CloseConnections(why);
    if (auto* gloo = dynamic_cast<AbortableGlooGroup*>(group_.get())) {
      gloo->ResetPairs();
    }
  }

  absl::Status Rejoin(std::unique_ptr<Communicator> fresh) override {
    auto* other = dynamic_cast<ProcessGroupCommunicator*>(fresh.get());
    if (other == nullptr || other->nccl_ != nccl_ || other->rank() != rank() ||
        other->size() != size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rejoin: the re-formed group (rank ", fresh->rank(), " of ",
          fresh->size(), ") does not match this one (rank ", rank(), " of ",
          size(), ")"));
    }
    // The old group's connections are closed, but it may still run
    // collectives whose waits were abandoned (AwaitUnlessFailed).
    Retire(std::exchange(group_, other->group_));
    ClearFailure();
    return absl::OkStatus();
  }

  absl::Status AllReduce(torch::Tensor& tensor, ReduceOp op) override {
    return AllReduceAsync(tensor, op).Wait();
  }

  // The backend runs the op on its own threads; the group's collective
  // timeout applies there, so Wait() fails (never hangs) when a peer is gone.
  PendingCollective AllReduceAsync(torch::Tensor tensor, ReduceOp op) override {
    if (absl::Status broken = failure(); !broken.ok()) {
      return PendingCollective::Done(broken);
    }
    stats_.Record(CommOp::kAllReduce, Bytes(tensor));
    if (GlooBFloat16(tensor)) {  // synchronously, through float32
      torch::Tensor wide = tensor.to(torch::kFloat32);
      absl::Status status = StartAllReduce(wide, op).Wait();
      if (status.ok()) tensor.copy_(wide);
      return PendingCollective::Done(status);
    }
    return StartAllReduce(tensor, op);
  }

  PendingCollective StartAllReduce(torch::Tensor tensor, ReduceOp op) {
    c10::intrusive_ptr<c10d::Work> work;
    absl::Status started = CatchTorch("all_reduce", [&] {
      std::vector<at::Tensor> tensors = {tensor};
      c10d::AllreduceOptions options;
      options.reduceOp =
          op == ReduceOp::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
      work = group_->allreduce(tensors, options);
    });
    if (!started.ok()) return PendingCollective::Done(Latch(started));
    return PendingCollective([this, work] {
      // Gloo does not fail an operation posted on a connection that already
      // failed: once the group failed, stop waiting for it.
      if (!nccl_) {
        absl::Status ended = CatchTorch(
            "all_reduce", [&] { return AwaitUnlessFailed(work->getFuture()); });
        if (!ended.ok()) return ended;
      }
      return Latch(CatchTorch("all_reduce", [&] { work->wait(); }));
    });
  }

  absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& input) override {
    TALLY_RETURN_IF_ERROR(failure());
    stats_.Record(CommOp::kAllGather, Bytes(input));
    return Latch(
        CatchTorch("all_gather", [&]() -> absl::StatusOr<torch::Tensor> {
          torch::Tensor contiguous = Wire(input.contiguous());
          std::vector<std::vector<at::Tensor>> outputs(1);
          for (int r = 0; r < size(); ++r) {
            outputs[0].push_back(torch::empty_like(contiguous));
          }
          std::vector<at::Tensor> inputs = {contiguous};
          group_->allgather(outputs, inputs)->wait();
          return torch::cat(outputs[0], 0).view(input.scalar_type());
        }));
  }

  absl::StatusOr<torch::Tensor> ReduceScatter(
      const torch::Tensor& input) override {
    TALLY_RETURN_IF_ERROR(failure());
    if (input.dim() == 0 || input.size(0) % size() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("reduce_scatter: dim 0 of ", c10::str(input.sizes()),
                       " is not divisible by the group size ", size()));
    }
    stats_.Record(CommOp::kReduceScatter, Bytes(input));
    return Latch(
        CatchTorch("reduce_scatter", [&]() -> absl::StatusOr<torch::Tensor> {
          int64_t chunk = input.size(0) / size();
          if (GlooBFloat16(input)) {
            std::vector<at::Tensor> tensors = {input.to(torch::kFloat32)};
            group_->allreduce(tensors)->wait();
            return tensors[0]
                .narrow(0, rank() * chunk, chunk)
                .to(input.scalar_type());
          }
          if (nccl_) {
            torch::Tensor contiguous = input.contiguous();
            torch::Tensor output =
                torch::empty_like(contiguous.narrow(0, 0, chunk));
            group_->_reduce_scatter_base(output, contiguous)->wait();
            return output;
          }
          std::vector<at::Tensor> tensors = {input.clone()};
          group_->allreduce(tensors)->wait();
          return tensors[0].narrow(0, rank() * chunk, chunk).clone();
        }));
  }

  absl::Status Broadcast(torch::Tensor& tensor, int root) override {
    TALLY_RETURN_IF_ERROR(failure());
    stats_.Record(CommOp::kBroadcast, Bytes(tensor));
    return Latch(CatchTorch("broadcast", [&] {
      std::vector<at::Tensor> tensors = {Wire(tensor)};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      group_->broadcast(tensors, options)->wait();
    }));
  }

  absl::Status Send(const torch::Tensor& tensor, int dst) override {
    TALLY_RETURN_IF_ERROR(failure());
    stats_.Record(CommOp::kSend, Bytes(tensor));
    return Latch(CatchTorch("send", [&] {
      std::vector<at::Tensor> tensors = {Wire(tensor.contiguous())};
      group_->send(tensors, dst, /*tag=*/0)->wait();
    }));
  }

  absl::Status Recv(torch::Tensor& tensor, int src) override {
    TALLY_RETURN_IF_ERROR(failure());
    stats_.Record(CommOp::kRecv, Bytes(tensor));
    return Latch(CatchTorch("recv", [&] {
      std::vector<at::Tensor> tensors = {Wire(tensor)};
      group_->recv(tensors, src, /*tag=*/0)->wait();
    }));
  }

  absl::Status SendRecv(const torch::Tensor& send, int dst, torch::Tensor& recv,
                        int src) override {
    TALLY_RETURN_IF_ERROR(failure());
    stats_.Record(CommOp::kSend, Bytes(send));
    stats_.Record(CommOp::kRecv, Bytes(recv));
    return Latch(CatchTorch("send_recv", [&] {
      std::vector<at::Tensor> incoming = {Wire(recv)};
      std::vector<at::Tensor> outgoing = {Wire(send.contiguous())};
      auto received = group_->recv(incoming, src, /*tag=*/0);
      auto sent = group_->send(outgoing, dst, /*tag=*/0);
      sent->wait();
      received->wait();
    }));
  }

 private:
  // Gloo in LibTorch 1.13 takes no bfloat16. Data that only moves goes as
  // float16 of the same bits (a view: nothing is converted); sums run in
  // float32 and are rounded back once.
  bool GlooBFloat16(const torch::Tensor& t) const {
    return !nccl_ && t.scalar_type() == torch::kBFloat16;
  }
  torch::Tensor Wire(const torch::Tensor& t) const {
    return GlooBFloat16(t) ? t.view(torch::kHalf) : t;
  }

  c10::intrusive_ptr<compat::C10dBackend> group_;
  // NCCL: bfloat16 and a native reduce-scatter; Gloo: neither.
  bool nccl_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeProcessGroupCommunicator(
    c10::intrusive_ptr<compat::C10dBackend> group) {
  if (!group) return absl::InvalidArgumentError("null process group");
  return std::unique_ptr<Communicator>(
      new ProcessGroupCommunicator(std::move(group)));
}

c10::intrusive_ptr<compat::C10dBackend> MakeAbortableGlooGroup(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size,
    std::shared_ptr<gloo::transport::Device> device,
    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(std::move(device));
  return c10::make_intrusive<AbortableGlooGroup>(std::move(store), rank, size,
                                                 options);
}

namespace {

std::atomic<CudaCommunicatorFactory> cuda_communicator_factory{nullptr};

}  // namespace

void SetCudaCommunicatorFactory(CudaCommunicatorFactory factory) {
  cuda_communicator_factory.store(factory);
}

absl::Status CheckCommunicatorDevice(torch::Device device) {
  if (device.is_cpu()) return absl::OkStatus();
  if (!device.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: ", device.str(),
                     " has no communicator; collectives run on cpu or cuda"));
  }
  if (!TALLY_TORCH_CUDA) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device.str(), ": this LibTorch (", TORCH_VERSION,
        ") was built without CUDA; build tally against a CUDA LibTorch"));
  }
  if (cuda_communicator_factory.load() == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device.str(),
        ": no NCCL communicator in this binary (tally_runtime_nccl is built "
        "only when CMake finds nvcc, nccl.h and libnccl, and the binary must "
        "call InstallNcclCommunicators())"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeCudaCommunicator(
    c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
    int size, int device, absl::Duration timeout) {
  TALLY_RETURN_IF_ERROR(CheckCommunicatorDevice(
      torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device))));
  return cuda_communicator_factory.load()(std::move(store), prefix, rank, size,
                                          device, timeout);
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeSingleRankCommunicator(
    torch::Device device) {
  TALLY_RETURN_IF_ERROR(CheckCommunicatorDevice(device));
  if (device.is_cuda()) {
    return MakeCudaCommunicator(c10::make_intrusive<c10d::HashStore>(),
                                "single", /*rank=*/0, /*size=*/1,
                                device.has_index() ? device.index() : 0,
                                kDefaultCollectiveTimeout);
  }
  return CatchTorch(
      "gloo single-rank group",
      [&]() -> absl::StatusOr<std::unique_ptr<Communicator>> {
        auto store = c10::make_intrusive<c10d::HashStore>();
        auto options = c10d::ProcessGroupGloo::Options::create();
        options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(
            store, /*rank=*/0, /*size=*/1, options);
        return MakeProcessGroupCommunicator(std::move(group));
      });
}

namespace {

// Marks the status AgreeOnStatus returns to a rank for a peer's failure.
constexpr char kPeerFailurePayload[] = "tally.dev/peer-failure";

bool IsPeerFailure(const absl::Status& status) {
  return status.GetPayload(kPeerFailurePayload).has_value();
}

// Every rank of `group` gets `root`'s status (which is not OK there): one
// broadcast of its code and message length, one of the message.
absl::StatusOr<absl::Status> ShareStatus(Communicator& group,
                                         const absl::Status& local, int root) {
  constexpr size_t kMaxMessage = 4096;
  std::string message(local.message().substr(0, kMaxMessage));
  torch::Tensor header = torch::tensor({static_cast<int64_t>(local.code()),
                                        static_cast<int64_t>(message.size())},
                                       torch::kInt64);
  TALLY_RETURN_IF_ERROR(group.Broadcast(header, root));
  const auto code = static_cast<absl::StatusCode>(header[0].item<int64_t>());
  message.resize(static_cast<size_t>(header[1].item<int64_t>()));
  if (!message.empty()) {
    torch::Tensor bytes = torch::from_blob(
        message.data(), {static_cast<int64_t>(message.size())}, torch::kUInt8);
    TALLY_RETURN_IF_ERROR(group.Broadcast(bytes, root));
  }
  return absl::Status(
      code == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : code,
      message);
}

}  // namespace

absl::Status AgreeOnStatus(Communicator& group, absl::Status local,
                           absl::string_view what) {
  if (group.size() == 1) return local;
  // A broken group fails fast rather than agree: its peers are dead, hung or
  // gone, and waiting for them would take a second collective timeout.
  if (absl::Status broken = group.failure(); !broken.ok()) {
    return local.ok() ? broken : local;
  }
  // The lowest failing rank, one that failed on its own first (a rank that
  // only heard of a peer's failure in an earlier agreement passes the word
  // on): 2n - rank for those, n - rank for the others, 0 when none failed.
  const int n = group.size(), rank = group.rank();
  double mine = 0;
  if (!local.ok()) mine = IsPeerFailure(local) ? n - rank : 2 * n - rank;
  torch::Tensor first = torch::tensor({mine}, torch::kFloat64);
  TALLY_RETURN_IF_ERROR(group.AllReduce(first, ReduceOp::kMax));
  const int failed = static_cast<int>(first.item<double>());
  if (failed == 0) return absl::OkStatus();
  const int root = failed > n ? 2 * n - failed : n - failed;
  TALLY_ASSIGN_OR_RETURN(const absl::Status shared,
                         ShareStatus(group, local, root));
  if (!local.ok() && !IsPeerFailure(local)) return local;
  absl::Status peer(shared.code(), absl::StrCat("rank ", root, " failed ", what,
                                                ": ", shared.message()));
  peer.SetPayload(kPeerFailurePayload, absl::Cord());
  return peer;
}

}  // namespace tally
