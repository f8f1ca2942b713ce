#include "runtime/cuda/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace tally {
namespace {

// How often a waiting call checks the stream and NCCL's asynchronous error.
constexpr std::chrono::microseconds kPollInterval(50);

absl::Status CudaStatus(cudaError_t error, const char* op, const char* call) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(op, ": ", call, ": ", cudaGetErrorString(error)));
}

absl::Status NcclStatus(ncclResult_t result, const char* op, const char* call) {
  if (result == ncclSuccess) return absl::OkStatus();
  // The result code is generic ("unhandled system error"); NCCL keeps the
  // specific cause (which peer, which socket) as its last error.
  const char* detail = ncclGetLastError(nullptr);
  return absl::InternalError(absl::StrCat(
      op, ": ", call, ": ", ncclGetErrorString(result),
      detail != nullptr && *detail != '\0' ? absl::StrCat(" (", detail, ")")
                                           : ""));
}

// The NCCL type of a tensor tally can stage, or INVALID_ARGUMENT naming why
// the tensor cannot be used.
absl::StatusOr<ncclDataType_t> NcclType(const char* op,
                                        const torch::Tensor& tensor) {
  if (!tensor.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": undefined tensor"));
  }
  if (!tensor.is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": tensor is on ", tensor.device().str(),
                     "; the NCCL communicator stages CPU tensors"));
  }
  switch (tensor.scalar_type()) {
    case torch::kFloat32:
      return ncclFloat32;
    case torch::kFloat64:
      return ncclFloat64;
    case torch::kInt64:
      return ncclInt64;
    case torch::kUInt8:
      return ncclUint8;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": dtype ", c10::toString(tensor.scalar_type()),
                       " is not supported (float32, float64, int64, uint8)"));
  }
}

size_t Bytes(const torch::Tensor& tensor) {
  return static_cast<size_t>(tensor.numel()) * tensor.element_size();
}

absl::Status CheckPeer(const char* op, const char* field, int peer, int size) {
  if (peer < 0 || peer >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", field, " ", peer, " is outside [0, size=", size, ")"));
  }
  return absl::OkStatus();
}

// Makes `device` current for the calling thread for its lifetime and then
// restores the caller's device, so a thread driving several devices (or other
// CUDA code) is not surprised.
class DeviceScope {
 public:
  DeviceScope(int device, const char* op) {
    status_ = CudaStatus(cudaGetDevice(&previous_), op, "cudaGetDevice");
    if (!status_.ok()) return;
    status_ = CudaStatus(cudaSetDevice(device), op, "cudaSetDevice");
    restore_ = status_.ok() && previous_ != device;
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (restore_) cudaSetDevice(previous_);
  }

  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
  int previous_ = 0;
  bool restore_ = false;
};

// What a staged call copies to the device buffer before the NCCL call (from
// `host` to `offset`) and back to the host after it.
struct Upload {
  const void* host = nullptr;
  size_t bytes = 0;
  size_t offset = 0;
};
struct Download {
  void* host = nullptr;
  size_t bytes = 0;
  size_t offset = 0;
};

// The NCCL call of a staged op, on the device buffer.
using NcclCall = std::function<ncclResult_t(char* buffer)>;

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device)
      : rank_(rank), size_(size), device_(device) {}
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // Best effort: a destructor has nobody to report a failure to.
  ~NcclCommunicator() override {
    DeviceScope scope(device_, "destroying the NCCL communicator");
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (buffer_ != nullptr) cudaFree(buffer_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Creates the stream and joins the communicator; blocks until all ranks
  // have joined.
  absl::Status Init(const ncclUniqueId& id) {
    constexpr const char* kOp = "creating the NCCL communicator";
    DeviceScope scope(device_, kOp);
    TALLY_RETURN_IF_ERROR(scope.status());
    // Non-blocking: never serialized with work on the legacy default stream.
    TALLY_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                   kOp, "cudaStreamCreateWithFlags"));
    return NcclStatus(ncclCommInitRank(&comm_, size_, id, rank_), kOp,
                      "ncclCommInitRank");
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduce(torch::Tensor& tensor, ReduceOp op) override {
    constexpr const char* kOp = "all_reduce";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(kOp, tensor));
    stats_.Record(CommOp::kAllReduce, Bytes(tensor));
    const ncclRedOp_t nccl_op = op == ReduceOp::kSum ? ncclSum : ncclMax;
    return InPlace(kOp, tensor, /*send=*/true, "ncclAllReduce",
                   [&](char* buffer) {
                     return ncclAllReduce(buffer, buffer, tensor.numel(), type,
                                          nccl_op, comm_, stream_);
                   });
  }

  absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& input) override {
    constexpr const char* kOp = "all_gather";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(kOp, input));
    if (input.dim() == 0) {
      return absl::InvalidArgumentError(
          "all_gather: input is 0-dim; it is gathered along dim 0");
    }
    stats_.Record(CommOp::kAllGather, Bytes(input));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor contiguous, Contiguous(kOp, input));
    std::vector<int64_t> output_shape = input.sizes().vec();
    output_shape[0] *= size_;
    TALLY_ASSIGN_OR_RETURN(torch::Tensor output,
                           Empty(kOp, output_shape, input.options()));
    const size_t bytes = Bytes(input);
    // In place as NCCL defines it: this rank's block already sits at its
    // slot of the gathered buffer, so one buffer serves both sides.
    TALLY_RETURN_IF_ERROR(Run(
        kOp, Upload{contiguous.data_ptr(), bytes, rank_ * bytes},
        "ncclAllGather",
        [&](char* buffer) {
          return ncclAllGather(buffer + rank_ * bytes, buffer, input.numel(),
                               type, comm_, stream_);
        },
        Download{output.data_ptr(), Bytes(output), 0}));
    return output;
  }

  absl::StatusOr<torch::Tensor> ReduceScatter(
      const torch::Tensor& input) override {
    constexpr const char* kOp = "reduce_scatter";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(kOp, input));
    if (input.dim() == 0 || input.size(0) % size_ != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("reduce_scatter: dim 0 of ", c10::str(input.sizes()),
                       " is not divisible by the group size ", size_));
    }
    stats_.Record(CommOp::kReduceScatter, Bytes(input));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor contiguous, Contiguous(kOp, input));
    std::vector<int64_t> output_shape = input.sizes().vec();
    output_shape[0] /= size_;
    TALLY_ASSIGN_OR_RETURN(torch::Tensor output,
                           Empty(kOp, output_shape, input.options()));
    const size_t chunk_bytes = Bytes(output);
    // In place as NCCL defines it: the result lands in this rank's slot.
    TALLY_RETURN_IF_ERROR(Run(
        kOp, Upload{contiguous.data_ptr(), Bytes(input), 0},
        "ncclReduceScatter",
        [&](char* buffer) {
          return ncclReduceScatter(buffer, buffer + rank_ * chunk_bytes,
                                   output.numel(), type, ncclSum, comm_,
                                   stream_);
        },
        Download{output.data_ptr(), chunk_bytes, rank_ * chunk_bytes}));
    return output;
  }

  absl::Status Broadcast(torch::Tensor& tensor, int root) override {
    constexpr const char* kOp = "broadcast";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(kOp, tensor));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "root", root, size_));
    stats_.Record(CommOp::kBroadcast, Bytes(tensor));
    // Only the root's values matter: the others skip the upload.
    return InPlace(kOp, tensor, /*send=*/rank_ == root, "ncclBroadcast",
                   [&](char* buffer) {
                     return ncclBroadcast(buffer, buffer, tensor.numel(), type,
                                          root, comm_, stream_);
                   });
  }

  absl::Status Send(const torch::Tensor& tensor, int dst) override {
    constexpr const char* kOp = "send";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(kOp, tensor));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "dst", dst, size_));
    if (dst == rank_) {
      return absl::InvalidArgumentError(
          "send: dst is this rank; a blocking send to itself never completes");
    }
    stats_.Record(CommOp::kSend, Bytes(tensor));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor contiguous, Contiguous(kOp, tensor));
    return Run(
        kOp, Upload{contiguous.data_ptr(), Bytes(tensor), 0}, "ncclSend",
        [&](char* buffer) {
          return ncclSend(buffer, tensor.numel(), type, dst, comm_, stream_);
        },
        Download{});
  }

  absl::Status Recv(torch::Tensor& tensor, int src) override {
    constexpr const char* kOp = "recv";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(kOp, tensor));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "src", src, size_));
    if (src == rank_) {
      return absl::InvalidArgumentError(
          "recv: src is this rank; a blocking recv from itself never "
          "completes");
    }
    stats_.Record(CommOp::kRecv, Bytes(tensor));
    return InPlace(kOp, tensor, /*send=*/false, "ncclRecv", [&](char* buffer) {
      return ncclRecv(buffer, tensor.numel(), type, src, comm_, stream_);
    });
  }

  // Both posted in one NCCL group, so two neighbours exchanging never wait
  // on each other's send. The device buffer holds the outgoing bytes, then
  // the incoming ones.
  absl::Status SendRecv(const torch::Tensor& send, int dst, torch::Tensor& recv,
                        int src) override {
    constexpr const char* kOp = "send_recv";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t send_type, NcclType(kOp, send));
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t recv_type, NcclType(kOp, recv));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "dst", dst, size_));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "src", src, size_));
    if (dst == rank_ || src == rank_) {
      return absl::InvalidArgumentError(
          "send_recv: dst and src must be other ranks");
    }
    stats_.Record(CommOp::kSend, Bytes(send));
    stats_.Record(CommOp::kRecv, Bytes(recv));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor outgoing, Contiguous(kOp, send));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor incoming, Contiguous(kOp, recv));
    const size_t send_bytes = Bytes(send);
    TALLY_RETURN_IF_ERROR(Run(
        kOp, Upload{outgoing.data_ptr(), send_bytes, 0}, "ncclSend/ncclRecv",
        [&](char* buffer) {
          ncclResult_t result = ncclGroupStart();
          if (result != ncclSuccess) return result;
          result =
              ncclSend(buffer, send.numel(), send_type, dst, comm_, stream_);
          const ncclResult_t received =
              ncclRecv(buffer + send_bytes, recv.numel(), recv_type, src, comm_,
                       stream_);
          const ncclResult_t ended = ncclGroupEnd();
          if (result != ncclSuccess) return result;
          return received != ncclSuccess ? received : ended;
        },
        Download{incoming.data_ptr(), Bytes(recv), send_bytes}));
    if (incoming.is_same(recv)) return absl::OkStatus();
    return CatchTorch(kOp, [&] { recv.copy_(incoming); });
  }

 private:
  static absl::StatusOr<torch::Tensor> Contiguous(const char* op,
                                                  const torch::Tensor& tensor) {
    return CatchTorch(op, [&]() -> absl::StatusOr<torch::Tensor> {
      return tensor.contiguous();
    });
  }

  static absl::StatusOr<torch::Tensor> Empty(
      const char* op, const std::vector<int64_t>& shape,
      const torch::TensorOptions& options) {
    return CatchTorch(op, [&]() -> absl::StatusOr<torch::Tensor> {
      return torch::empty(shape, options);
    });
  }

  // An op whose result replaces `tensor`: uploads it when `send`, runs
  // `nccl_call` and downloads the result into it (through a contiguous copy
  // when `tensor` is a strided view).
  absl::Status InPlace(const char* op, torch::Tensor& tensor, bool send,
                       const char* nccl_name, const NcclCall& nccl_call) {
    TALLY_ASSIGN_OR_RETURN(torch::Tensor contiguous, Contiguous(op, tensor));
    const size_t bytes = Bytes(tensor);
    TALLY_RETURN_IF_ERROR(
        Run(op, Upload{contiguous.data_ptr(), send ? bytes : 0, 0}, nccl_name,
            nccl_call, Download{contiguous.data_ptr(), bytes, 0}));
    if (contiguous.is_same(tensor)) return absl::OkStatus();
    return CatchTorch(op, [&] { tensor.copy_(contiguous); });
  }

  // Uploads, runs `nccl_call` on the device buffer, downloads and waits for
  // all of it.
  absl::Status Run(const char* op, const Upload& upload, const char* nccl_name,
                   const NcclCall& nccl_call, const Download& download) {
    TALLY_RETURN_IF_ERROR(aborted_);
    DeviceScope scope(device_, op);
    TALLY_RETURN_IF_ERROR(scope.status());
    TALLY_RETURN_IF_ERROR(
        Reserve(op, std::max(upload.offset + upload.bytes,
                             download.offset + download.bytes)));
    if (upload.bytes > 0) {
      TALLY_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(buffer_ + upload.offset, upload.host, upload.bytes,
                          cudaMemcpyHostToDevice, stream_),
          op, "cudaMemcpyAsync to the device"));
    }
    TALLY_RETURN_IF_ERROR(NcclStatus(nccl_call(buffer_), op, nccl_name));
    if (download.bytes > 0) {
      TALLY_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(download.host, buffer_ + download.offset,
                          download.bytes, cudaMemcpyDeviceToHost, stream_),
          op, "cudaMemcpyAsync to the host"));
    }
    return WaitForStream(op);
  }

  // Grows the device buffer to at least `bytes`. Never leaves it null, so
  // NCCL sees a valid pointer even for an empty tensor.
  absl::Status Reserve(const char* op, size_t bytes) {
    if (bytes <= capacity_ && buffer_ != nullptr) return absl::OkStatus();
    // Doubling: a run of growing tensors reallocates O(log n) times.
    const size_t capacity = std::max<size_t>({bytes, 2 * capacity_, 1});
    if (buffer_ != nullptr) {
      TALLY_RETURN_IF_ERROR(CudaStatus(cudaFree(buffer_), op, "cudaFree"));
      buffer_ = nullptr;
      capacity_ = 0;
    }
    void* buffer = nullptr;
    TALLY_RETURN_IF_ERROR(
        CudaStatus(cudaMalloc(&buffer, capacity), op, "cudaMalloc"));
    buffer_ = static_cast<char*>(buffer);
    capacity_ = capacity;
    return absl::OkStatus();
  }

  // Polls instead of cudaStreamSynchronize: when a peer dies mid-collective
  // the stream never drains, and NCCL reports it only through
  // ncclCommGetAsyncError.
  absl::Status WaitForStream(const char* op) {
    while (true) {
      const cudaError_t state = cudaStreamQuery(stream_);
      if (state == cudaSuccess) return absl::OkStatus();
      if (state != cudaErrorNotReady) {
        return CudaStatus(state, op, "cudaStreamQuery");
      }
      ncclResult_t async_error = ncclSuccess;
      TALLY_RETURN_IF_ERROR(
          NcclStatus(ncclCommGetAsyncError(comm_, &async_error), op,
                     "ncclCommGetAsyncError"));
      if (async_error != ncclSuccess) {
        const absl::Status cause =
            NcclStatus(async_error, op, "ncclCommGetAsyncError");
        aborted_ = absl::InternalError(
            absl::StrCat(cause.message(), "; the communicator was aborted"));
        ncclCommAbort(comm_);
        comm_ = nullptr;
        return aborted_;
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  const int rank_;
  const int size_;
  const int device_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  char* buffer_ = nullptr;  // device memory
  size_t capacity_ = 0;
  // Set once NCCL reported an asynchronous error and the communicator was
  // aborted; every later call returns it.
  absl::Status aborted_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
    int size, int device) {
  if (!store) return absl::InvalidArgumentError("store: null");
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("size: must be >= 1, got ", size));
  }
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, " is outside [0, size=", size, ")"));
  }
  if (device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: must be >= 0, got ", device));
  }
  int device_count = 0;
  const cudaError_t count_error = cudaGetDeviceCount(&device_count);
  if (count_error != cudaSuccess || device_count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device for the NCCL communicator: cudaGetDeviceCount: ",
        count_error != cudaSuccess ? cudaGetErrorString(count_error)
                                   : "0 devices"));
  }
  if (device >= device_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: ", device, " is outside [0, ", device_count,
                     " visible CUDA devices)"));
  }

  const std::string key = absl::StrCat(prefix, "/nccl_id");
  ncclUniqueId id;
  if (rank == 0) {
    TALLY_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id),
                                     "creating the NCCL communicator",
                                     "ncclGetUniqueId"));
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    const std::string what = absl::StrCat("publishing the NCCL id at ", key);
    TALLY_RETURN_IF_ERROR(CatchTorch(what.c_str(), [&] {
      store->set(key, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
    }));
  } else {
    const std::string what = absl::StrCat("waiting for the NCCL id at ", key);
    std::vector<uint8_t> bytes;
    TALLY_RETURN_IF_ERROR(
        CatchTorch(what.c_str(), [&] { bytes = store->get(key); }));
    if (bytes.size() != sizeof(id)) {
      return absl::InternalError(absl::StrCat(key, ": holds ", bytes.size(),
                                              " bytes, not the ", sizeof(id),
                                              " of an ncclUniqueId"));
    }
    std::memcpy(&id, bytes.data(), sizeof(id));
  }

  auto communicator = std::make_unique<NcclCommunicator>(rank, size, device);
  TALLY_RETURN_IF_ERROR(communicator->Init(id));
  return std::unique_ptr<Communicator>(std::move(communicator));
}

}  // namespace tally
