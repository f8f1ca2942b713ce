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
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "runtime/parallel/torch_compat.h"

#if TALLY_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

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

// The NCCL type of a tensor, or INVALID_ARGUMENT naming why the tensor cannot
// be used. A CUDA tensor must be on the communicator's device.
absl::StatusOr<ncclDataType_t> NcclType(const char* op,
                                        const torch::Tensor& tensor,
                                        int device) {
  if (!tensor.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": undefined tensor"));
  }
  if (tensor.is_cuda() && tensor.device().index() != device) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": tensor is on ", tensor.device().str(),
                     "; this NCCL communicator is on cuda:", device));
  }
  if (!tensor.is_cpu() && !tensor.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": tensor is on ", tensor.device().str(),
                     "; the NCCL communicator takes CPU or CUDA tensors"));
  }
  switch (tensor.scalar_type()) {
    case torch::kFloat32:
      return ncclFloat32;
    case torch::kFloat64:
      return ncclFloat64;
    case torch::kBFloat16:
      return ncclBfloat16;
    case torch::kInt64:
      return ncclInt64;
    case torch::kUInt8:
      return ncclUint8;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": dtype ", c10::toString(tensor.scalar_type()),
          " is not supported (float32, float64, bfloat16, int64, uint8)"));
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

// The stream LibTorch queues this thread's work for `device` on. The NCCL
// stream waits for it before it reads or writes a CUDA tensor.
cudaStream_t TorchStream(int device) {
#if TALLY_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device))
      .stream();
#else
  // A LibTorch without CUDA has no CUDA tensors and never queues work.
  return cudaStreamLegacy;
#endif
}

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

// Where the NCCL call of an op reads and writes. CUDA tensors are handed to
// NCCL as they are; CPU tensors go through the staging buffer, NCCL reading
// it at `send_offset` and writing it at `recv_offset`.
struct Operands {
  static Operands OnDevice(const void* send, void* recv) {
    Operands operands;
    operands.on_device = true;
    operands.send = send;
    operands.recv = recv;
    return operands;
  }
  static Operands Staged(size_t send_offset, size_t recv_offset,
                         const Upload& upload, const Download& download) {
    Operands operands;
    operands.send_offset = send_offset;
    operands.recv_offset = recv_offset;
    operands.upload = upload;
    operands.download = download;
    return operands;
  }

  bool on_device = false;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t send_offset = 0;
  size_t recv_offset = 0;
  Upload upload;
  Download download;
};

// The NCCL call of an op, on device memory.
using NcclCall = std::function<ncclResult_t(const void* send, void* recv)>;

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, absl::Duration timeout)
      : rank_(rank), size_(size), device_(device), timeout_(timeout) {}
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // Best effort: a destructor has nobody to report a failure to.
  ~NcclCommunicator() override {
    DeviceScope scope(device_, "destroying the NCCL communicator");
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (buffer_ != nullptr) cudaFree(buffer_);
    if (torch_ready_ != nullptr) cudaEventDestroy(torch_ready_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Creates the stream and joins the communicator; blocks until all ranks
  // have joined.
  absl::Status Init(const ncclUniqueId& id) {
    constexpr const char* kOp = "creating the NCCL communicator";
    DeviceScope scope(device_, kOp);
    TALLY_RETURN_IF_ERROR(scope.status());
    // Non-blocking: never serialized with work on the legacy default stream;
    // CUDA tensors are ordered after LibTorch's work by `torch_ready_`.
    TALLY_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                   kOp, "cudaStreamCreateWithFlags"));
    TALLY_RETURN_IF_ERROR(CudaStatus(
        cudaEventCreateWithFlags(&torch_ready_, cudaEventDisableTiming), kOp,
        "cudaEventCreateWithFlags"));
    return NcclStatus(ncclCommInitRank(&comm_, size_, id, rank_), kOp,
                      "ncclCommInitRank");
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduce(torch::Tensor& tensor, ReduceOp op) override {
    constexpr const char* kOp = "all_reduce";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, Check(kOp, tensor));
    stats_.Record(CommOp::kAllReduce, Bytes(tensor));
    if (type != ncclBfloat16) return Reduce(kOp, tensor, type, op);
    // Summed in float32 and rounded once, as the Gloo communicator does.
    TALLY_ASSIGN_OR_RETURN(torch::Tensor wide,
                           To(kOp, tensor, torch::kFloat32));
    TALLY_RETURN_IF_ERROR(Reduce(kOp, wide, ncclFloat32, op));
    return CatchTorch(kOp, [&] { tensor.copy_(wide); });
  }

  absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& input) override {
    constexpr const char* kOp = "all_gather";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, Check(kOp, input));
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
    // Staged in place as NCCL defines it: this rank's block already sits at
    // its slot of the gathered buffer, so one buffer serves both sides.
    const Operands operands =
        contiguous.is_cuda()
            ? Operands::OnDevice(contiguous.data_ptr(), output.data_ptr())
            : Operands::Staged(
                  rank_ * bytes, 0,
                  Upload{contiguous.data_ptr(), bytes, rank_ * bytes},
                  Download{output.data_ptr(), Bytes(output), 0});
    TALLY_RETURN_IF_ERROR(Run(
        kOp, "ncclAllGather",
        [&](const void* send, void* recv) {
          return ncclAllGather(send, recv, input.numel(), type, comm_, stream_);
        },
        operands));
    return output;
  }

  absl::StatusOr<torch::Tensor> ReduceScatter(
      const torch::Tensor& input) override {
    constexpr const char* kOp = "reduce_scatter";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, Check(kOp, input));
    if (input.dim() == 0 || input.size(0) % size_ != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("reduce_scatter: dim 0 of ", c10::str(input.sizes()),
                       " is not divisible by the group size ", size_));
    }
    stats_.Record(CommOp::kReduceScatter, Bytes(input));
    if (type != ncclBfloat16) return ScatterSum(kOp, input, type);
    // Summed in float32 and rounded once, as the Gloo communicator does.
    TALLY_ASSIGN_OR_RETURN(torch::Tensor wide, To(kOp, input, torch::kFloat32));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor sum,
                           ScatterSum(kOp, wide, ncclFloat32));
    return To(kOp, sum, torch::kBFloat16);
  }

  absl::Status Broadcast(torch::Tensor& tensor, int root) override {
    constexpr const char* kOp = "broadcast";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, Check(kOp, tensor));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "root", root, size_));
    stats_.Record(CommOp::kBroadcast, Bytes(tensor));
    // Only the root's values matter: the others skip the upload.
    return InPlace(kOp, tensor, /*send=*/rank_ == root, "ncclBroadcast",
                   [&](const void* send, void* recv) {
                     return ncclBroadcast(send, recv, tensor.numel(), type,
                                          root, comm_, stream_);
                   });
  }

  absl::Status Send(const torch::Tensor& tensor, int dst) override {
    constexpr const char* kOp = "send";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, Check(kOp, tensor));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "dst", dst, size_));
    if (dst == rank_) {
      return absl::InvalidArgumentError(
          "send: dst is this rank; a blocking send to itself never completes");
    }
    stats_.Record(CommOp::kSend, Bytes(tensor));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor contiguous, Contiguous(kOp, tensor));
    const Operands operands =
        contiguous.is_cuda()
            ? Operands::OnDevice(contiguous.data_ptr(), nullptr)
            : Operands::Staged(0, 0,
                               Upload{contiguous.data_ptr(), Bytes(tensor), 0},
                               Download{});
    return Run(
        kOp, "ncclSend",
        [&](const void* send, void*) {
          return ncclSend(send, tensor.numel(), type, dst, comm_, stream_);
        },
        operands);
  }

  absl::Status Recv(torch::Tensor& tensor, int src) override {
    constexpr const char* kOp = "recv";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t type, Check(kOp, tensor));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "src", src, size_));
    if (src == rank_) {
      return absl::InvalidArgumentError(
          "recv: src is this rank; a blocking recv from itself never "
          "completes");
    }
    stats_.Record(CommOp::kRecv, Bytes(tensor));
    return InPlace(
        kOp, tensor, /*send=*/false, "ncclRecv", [&](const void*, void* recv) {
          return ncclRecv(recv, tensor.numel(), type, src, comm_, stream_);
        });
  }

  // Both posted in one NCCL group, so two neighbours exchanging never wait
  // on each other's send. Staged, the buffer holds the outgoing bytes, then
  // the incoming ones.
  absl::Status SendRecv(const torch::Tensor& send, int dst, torch::Tensor& recv,
                        int src) override {
    constexpr const char* kOp = "send_recv";
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t send_type, Check(kOp, send));
    TALLY_ASSIGN_OR_RETURN(ncclDataType_t recv_type, Check(kOp, recv));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "dst", dst, size_));
    TALLY_RETURN_IF_ERROR(CheckPeer(kOp, "src", src, size_));
    if (dst == rank_ || src == rank_) {
      return absl::InvalidArgumentError(
          "send_recv: dst and src must be other ranks");
    }
    if (send.is_cuda() != recv.is_cuda()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "send_recv: send is on ", send.device().str(), " and recv on ",
          recv.device().str(), "; both must be CPU or both CUDA tensors"));
    }
    stats_.Record(CommOp::kSend, Bytes(send));
    stats_.Record(CommOp::kRecv, Bytes(recv));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor outgoing, Contiguous(kOp, send));
    TALLY_ASSIGN_OR_RETURN(torch::Tensor incoming, Contiguous(kOp, recv));
    const size_t send_bytes = Bytes(send);
    const Operands operands =
        outgoing.is_cuda()
            ? Operands::OnDevice(outgoing.data_ptr(), incoming.data_ptr())
            : Operands::Staged(
                  0, send_bytes, Upload{outgoing.data_ptr(), send_bytes, 0},
                  Download{incoming.data_ptr(), Bytes(recv), send_bytes});
    TALLY_RETURN_IF_ERROR(Run(
        kOp, "ncclSend/ncclRecv",
        [&](const void* send_buffer, void* recv_buffer) {
          ncclResult_t result = ncclGroupStart();
          if (result != ncclSuccess) return result;
          result = ncclSend(send_buffer, send.numel(), send_type, dst, comm_,
                            stream_);
          const ncclResult_t received = ncclRecv(
              recv_buffer, recv.numel(), recv_type, src, comm_, stream_);
          const ncclResult_t ended = ncclGroupEnd();
          if (result != ncclSuccess) return result;
          return received != ncclSuccess ? received : ended;
        },
        operands));
    if (incoming.is_same(recv)) return absl::OkStatus();
    return CatchTorch(kOp, [&] { recv.copy_(incoming); });
  }

 private:
  // The NCCL type of `tensor` for a call of a communicator that has not
  // failed: a failed one returns its failure at once.
  absl::StatusOr<ncclDataType_t> Check(const char* op,
                                       const torch::Tensor& tensor) const {
    TALLY_RETURN_IF_ERROR(failure());
    return NcclType(op, tensor, device_);
  }

  static absl::StatusOr<torch::Tensor> Contiguous(const char* op,
                                                  const torch::Tensor& tensor) {
    return CatchTorch(op, [&]() -> absl::StatusOr<torch::Tensor> {
      return tensor.contiguous();
    });
  }

  static absl::StatusOr<torch::Tensor> To(const char* op,
                                          const torch::Tensor& tensor,
                                          torch::Dtype dtype) {
    return CatchTorch(op, [&]() -> absl::StatusOr<torch::Tensor> {
      return tensor.to(dtype);
    });
  }

  static absl::StatusOr<torch::Tensor> Empty(
      const char* op, const std::vector<int64_t>& shape,
      const torch::TensorOptions& options) {
    return CatchTorch(op, [&]() -> absl::StatusOr<torch::Tensor> {
      return torch::empty(shape, options);
    });
  }

  // The all-reduce of `tensor`, whose NCCL type is `type`, in place.
  absl::Status Reduce(const char* op, torch::Tensor& tensor,
                      ncclDataType_t type, ReduceOp reduce) {
    const ncclRedOp_t nccl_op = reduce == ReduceOp::kSum ? ncclSum : ncclMax;
    return InPlace(op, tensor, /*send=*/true, "ncclAllReduce",
                   [&](const void* send, void* recv) {
                     return ncclAllReduce(send, recv, tensor.numel(), type,
                                          nccl_op, comm_, stream_);
                   });
  }

  // This rank's dim-0 slice of the sum of every rank's `input`.
  absl::StatusOr<torch::Tensor> ScatterSum(const char* op,
                                           const torch::Tensor& input,
                                           ncclDataType_t type) {
    TALLY_ASSIGN_OR_RETURN(torch::Tensor contiguous, Contiguous(op, input));
    std::vector<int64_t> output_shape = input.sizes().vec();
    output_shape[0] /= size_;
    TALLY_ASSIGN_OR_RETURN(torch::Tensor output,
                           Empty(op, output_shape, input.options()));
    const size_t chunk_bytes = Bytes(output);
    // Staged in place as NCCL defines it: the result lands in this rank's
    // slot.
    const Operands operands =
        contiguous.is_cuda()
            ? Operands::OnDevice(contiguous.data_ptr(), output.data_ptr())
            : Operands::Staged(0, rank_ * chunk_bytes,
                               Upload{contiguous.data_ptr(), Bytes(input), 0},
                               Download{output.data_ptr(), chunk_bytes,
                                        rank_ * chunk_bytes});
    TALLY_RETURN_IF_ERROR(Run(
        op, "ncclReduceScatter",
        [&](const void* send, void* recv) {
          return ncclReduceScatter(send, recv, output.numel(), type, ncclSum,
                                   comm_, stream_);
        },
        operands));
    return output;
  }

  // An op whose result replaces `tensor`: reads it when `send`, runs
  // `nccl_call` and writes the result into it (through a contiguous copy
  // when `tensor` is a strided view).
  absl::Status InPlace(const char* op, torch::Tensor& tensor, bool send,
                       const char* nccl_name, const NcclCall& nccl_call) {
    TALLY_ASSIGN_OR_RETURN(torch::Tensor contiguous, Contiguous(op, tensor));
    const size_t bytes = Bytes(tensor);
    const Operands operands =
        contiguous.is_cuda()
            ? Operands::OnDevice(contiguous.data_ptr(), contiguous.data_ptr())
            : Operands::Staged(
                  0, 0, Upload{contiguous.data_ptr(), send ? bytes : 0, 0},
                  Download{contiguous.data_ptr(), bytes, 0});
    TALLY_RETURN_IF_ERROR(Run(op, nccl_name, nccl_call, operands));
    if (contiguous.is_same(tensor)) return absl::OkStatus();
    return CatchTorch(op, [&] { tensor.copy_(contiguous); });
  }

  // Runs `nccl_call` on `operands` and waits for it. A failure, or a call
  // still running after the timeout, breaks the communicator for good.
  absl::Status Run(const char* op, const char* nccl_name,
                   const NcclCall& nccl_call, const Operands& operands) {
    DeviceScope scope(device_, op);
    TALLY_RETURN_IF_ERROR(scope.status());
    if (operands.on_device) {
      return Latch(RunOnDevice(op, nccl_name, nccl_call, operands));
    }
    return Latch(RunStaged(op, nccl_name, nccl_call, operands));
  }

  // CUDA tensors: the NCCL stream first waits for the work LibTorch queued
  // on them, then NCCL reads and writes them where they are.
  absl::Status RunOnDevice(const char* op, const char* nccl_name,
                           const NcclCall& nccl_call,
                           const Operands& operands) {
    TALLY_RETURN_IF_ERROR(
        CudaStatus(cudaEventRecord(torch_ready_, TorchStream(device_)), op,
                   "cudaEventRecord"));
    TALLY_RETURN_IF_ERROR(
        CudaStatus(cudaStreamWaitEvent(stream_, torch_ready_, 0), op,
                   "cudaStreamWaitEvent"));
    TALLY_RETURN_IF_ERROR(
        NcclStatus(nccl_call(operands.send, operands.recv), op, nccl_name));
    return WaitForStream(op);
  }

  // CPU tensors: uploads, runs `nccl_call` on the device buffer, downloads.
  absl::Status RunStaged(const char* op, const char* nccl_name,
                         const NcclCall& nccl_call, const Operands& operands) {
    const Upload& upload = operands.upload;
    const Download& download = operands.download;
    TALLY_RETURN_IF_ERROR(
        Reserve(op, std::max(upload.offset + upload.bytes,
                             download.offset + download.bytes)));
    if (upload.bytes > 0) {
      TALLY_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(buffer_ + upload.offset, upload.host, upload.bytes,
                          cudaMemcpyHostToDevice, stream_),
          op, "cudaMemcpyAsync to the device"));
    }
    TALLY_RETURN_IF_ERROR(NcclStatus(nccl_call(buffer_ + operands.send_offset,
                                               buffer_ + operands.recv_offset),
                                     op, nccl_name));
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
  // ncclCommGetAsyncError, or not at all when the peer hangs; past the
  // timeout the communicator is aborted.
  absl::Status WaitForStream(const char* op) {
    const absl::Time deadline = absl::Now() + timeout_;
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
        return Abort(NcclStatus(async_error, op, "ncclCommGetAsyncError"));
      }
      if (absl::Now() >= deadline) {
        return Abort(absl::DeadlineExceededError(
            absl::StrCat(op, ": not complete after the collective timeout of ",
                         absl::FormatDuration(timeout_),
                         " (a peer is dead, hung or in another collective)")));
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  // Aborts the communicator after `cause`: NCCL's kernels of this
  // communicator stop, and every later call fails with the returned status.
  absl::Status Abort(const absl::Status& cause) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
    return absl::Status(
        cause.code(),
        absl::StrCat(cause.message(), "; the communicator was aborted"));
  }

  const int rank_;
  const int size_;
  const int device_;
  const absl::Duration timeout_;
  cudaStream_t stream_ = nullptr;
  // Recorded on LibTorch's stream before each op on CUDA tensors.
  cudaEvent_t torch_ready_ = nullptr;
  ncclComm_t comm_ = nullptr;
  char* buffer_ = nullptr;  // device memory
  size_t capacity_ = 0;
};

// Every rank of the communicator `prefix` marks that it has arrived and waits
// for the others within the store's timeout, so a rank whose peer never
// comes fails here (naming the missing ranks) instead of blocking forever in
// ncclCommInitRank.
absl::Status JoinRendezvous(c10d::Store& store, const std::string& prefix,
                            int rank, int size) {
  auto key = [&](int r) { return absl::StrCat(prefix, "/joined/", r); };
  const std::string what =
      absl::StrCat("joining the NCCL communicator ", prefix);
  TALLY_RETURN_IF_ERROR(CatchTorch(
      what.c_str(), [&] { store.set(key(rank), std::vector<uint8_t>{1}); }));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key(r));
  if (CatchTorch(what.c_str(), [&] { store.wait(keys); }).ok()) {
    return absl::OkStatus();
  }
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    bool present = false;
    CatchTorch(what.c_str(), [&] {
      present = store.check({key(r)});
    }).IgnoreError();
    if (!present) missing.push_back(r);
  }
  return absl::DeadlineExceededError(
      absl::StrCat(what, ": ranks {", absl::StrJoin(missing, ","),
                   "} did not join within the store's timeout"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
    int size, int device, absl::Duration timeout) {
  if (!store) return absl::InvalidArgumentError("store: null");
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "timeout: must be positive, got ", absl::FormatDuration(timeout)));
  }
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

  TALLY_RETURN_IF_ERROR(JoinRendezvous(*store, prefix, rank, size));
  auto communicator =
      std::make_unique<NcclCommunicator>(rank, size, device, timeout);
  TALLY_RETURN_IF_ERROR(communicator->Init(id));
  return std::unique_ptr<Communicator>(std::move(communicator));
}

void InstallNcclCommunicators() {
  SetCudaCommunicatorFactory(&MakeNcclCommunicator);
}

}  // namespace tally
