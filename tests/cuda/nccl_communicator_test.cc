#include "runtime/cuda/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "runtime/parallel/torch_compat.h"

#if TALLY_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace tally {
namespace {

using ::testing::HasSubstr;

// Why this machine cannot run a test needing `needed` CUDA devices, or nullopt
// when it can.
std::optional<std::string> MissingDevices(int needed) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    return absl::StrCat("no CUDA device: cudaGetDeviceCount: ",
                        cudaGetErrorString(error));
  }
  if (count == 0) return "no CUDA device: cudaGetDeviceCount returned 0";
  if (count < needed) {
    return absl::StrCat("needs ", needed, " CUDA devices, found ", count);
  }
  return std::nullopt;
}

c10::intrusive_ptr<c10d::Store> NewStore() {
  return c10::make_intrusive<c10d::HashStore>();
}

// Distinct per rank and exact in every dtype used, so the device's sums equal
// the host's bitwise: (rank + 1) * 0.5 * i + 2^rank for i in [0, n).
torch::Tensor RankValues(int rank, int64_t n, torch::Dtype dtype) {
  return (torch::arange(n, torch::kFloat64) * 0.5 * (rank + 1) +
          std::ldexp(1.0, rank))
      .to(dtype);
}

// One input per collective, each in a different supported dtype.
torch::Tensor SumInput(int rank) {
  return RankValues(rank, 12, torch::kFloat32).reshape({3, 4});
}
// Rank 0 rises and rank 1 falls, so the maximum takes from both.
torch::Tensor MaxInput(int rank) {
  torch::Tensor ramp = torch::arange(6, torch::kInt64);
  return rank == 0 ? ramp : 5 - ramp;
}
torch::Tensor GatherInput(int rank) {
  return RankValues(rank, 6, torch::kUInt8).reshape({2, 3});
}
torch::Tensor ScatterInput(int rank) {
  return RankValues(rank, 8, torch::kFloat64).reshape({4, 2});
}
torch::Tensor BroadcastInput(int rank) {
  return RankValues(rank, 5, torch::kInt64);
}
torch::Tensor SendInput() {
  return torch::tensor({1.25, -3.5, 1e300}, torch::kFloat64);
}

void ExpectCounter(const CommStats& stats, CommOp op, int64_t calls,
                   int64_t bytes) {
  EXPECT_EQ(stats.Get(op).calls, calls) << CommOpName(op);
  EXPECT_EQ(stats.Get(op).bytes, bytes) << CommOpName(op);
}

// Argument checks come before any CUDA call, so this runs without a device.
TEST(NcclCommunicatorArgumentsTest, RejectsInvalidArguments) {
  struct Case {
    c10::intrusive_ptr<c10d::Store> store;
    int rank;
    int size;
    int device;
    std::string field;
    absl::Duration timeout = absl::Minutes(1);
  };
  const std::vector<Case> cases = {
      {c10::intrusive_ptr<c10d::Store>(), 0, 1, 0, "store"},
      {NewStore(), 0, 0, 0, "size"},
      {NewStore(), -1, 2, 0, "rank"},
      {NewStore(), 2, 2, 0, "rank"},
      {NewStore(), 0, 1, -1, "device"},
      {NewStore(), 0, 1, 0, "timeout", absl::ZeroDuration()},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::unique_ptr<Communicator>> communicator =
        MakeNcclCommunicator(c.store, "args", c.rank, c.size, c.device,
                             c.timeout);
    EXPECT_EQ(communicator.status().code(), absl::StatusCode::kInvalidArgument)
        << c.field << ": " << communicator.status();
    EXPECT_EQ(communicator.status().message().rfind(c.field + ":", 0), 0u)
        << communicator.status();
  }
}

// The inverse of every other test: checks the error a machine without a
// device gets, so it runs only there.
TEST(NcclCommunicatorArgumentsTest, WithoutDeviceIsFailedPrecondition) {
  if (!MissingDevices(1)) {
    GTEST_SKIP() << "a CUDA device is present; this checks the error on a "
                    "machine without one";
  }
  absl::StatusOr<std::unique_ptr<Communicator>> communicator =
      MakeNcclCommunicator(NewStore(), "solo", 0, 1, 0);
  EXPECT_EQ(communicator.status().code(), absl::StatusCode::kFailedPrecondition)
      << communicator.status();
  EXPECT_NE(communicator.status().message().find("no CUDA device"),
            std::string::npos)
      << communicator.status();
}

// With the NCCL communicator installed, a CUDA single-rank communicator
// still needs a LibTorch with CUDA and a device; with both it is NCCL's.
TEST(NcclCommunicatorArgumentsTest, InstalledCudaSingleRankCommunicator) {
  InstallNcclCommunicators();
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      MakeSingleRankCommunicator(torch::Device(torch::kCUDA, 0));
  if (!TALLY_TORCH_CUDA) {
    EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition)
        << made.status();
    EXPECT_THAT(std::string(made.status().message()),
                HasSubstr("built without CUDA"));
    return;
  }
  if (auto reason = MissingDevices(1)) {
    EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition)
        << made.status();
    EXPECT_THAT(std::string(made.status().message()),
                HasSubstr("no CUDA device"));
    return;
  }
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ((*made)->size(), 1);
  torch::Tensor sum = SumInput(0);
  ASSERT_TRUE((*made)->AllReduce(sum, ReduceOp::kSum).ok());
  EXPECT_TRUE(torch::equal(sum, SumInput(0)));
}

TEST(NcclCommunicatorTest, WorldOfOneRoundTripsEveryOpAndCountsBytes) {
  if (auto reason = MissingDevices(1)) GTEST_SKIP() << *reason;
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      MakeNcclCommunicator(NewStore(), "solo", 0, 1, 0);
  ASSERT_TRUE(made.ok()) << made.status();
  Communicator& solo = **made;
  EXPECT_EQ(solo.rank(), 0);
  EXPECT_EQ(solo.size(), 1);

  // A world of one reduces over one contribution: every op is the identity.
  torch::Tensor sum = SumInput(0);
  ASSERT_TRUE(solo.AllReduce(sum, ReduceOp::kSum).ok());
  EXPECT_TRUE(torch::equal(sum, SumInput(0)));

  torch::Tensor max = MaxInput(0);
  ASSERT_TRUE(solo.AllReduce(max, ReduceOp::kMax).ok());
  EXPECT_TRUE(torch::equal(max, MaxInput(0)));

  // A strided view comes back in its own layout, not the staged one.
  torch::Tensor base = torch::arange(12, torch::kInt64).reshape({3, 4});
  torch::Tensor transposed = base.t();
  ASSERT_FALSE(transposed.is_contiguous());
  ASSERT_TRUE(solo.AllReduce(transposed, ReduceOp::kSum).ok());
  EXPECT_TRUE(
      torch::equal(base, torch::arange(12, torch::kInt64).reshape({3, 4})));

  torch::Tensor empty = torch::empty({0}, torch::kFloat32);
  ASSERT_TRUE(solo.AllReduce(empty, ReduceOp::kSum).ok());

  absl::StatusOr<torch::Tensor> gathered = solo.AllGather(GatherInput(0));
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  EXPECT_TRUE(torch::equal(*gathered, GatherInput(0)));

  absl::StatusOr<torch::Tensor> scattered = solo.ReduceScatter(ScatterInput(0));
  ASSERT_TRUE(scattered.ok()) << scattered.status();
  EXPECT_TRUE(torch::equal(*scattered, ScatterInput(0)));

  torch::Tensor broadcast = BroadcastInput(0);
  ASSERT_TRUE(solo.Broadcast(broadcast, /*root=*/0).ok());
  EXPECT_TRUE(torch::equal(broadcast, BroadcastInput(0)));

  const CommStats& stats = solo.stats();
  ExpectCounter(
      stats, CommOp::kAllReduce, 4,
      12 * sizeof(float) + 6 * sizeof(int64_t) + 12 * sizeof(int64_t));
  ExpectCounter(stats, CommOp::kAllGather, 1, 6 * sizeof(uint8_t));
  ExpectCounter(stats, CommOp::kReduceScatter, 1, 8 * sizeof(double));
  ExpectCounter(stats, CommOp::kBroadcast, 1, 5 * sizeof(int64_t));
  EXPECT_EQ(stats.TotalCalls(), 7);
}

TEST(NcclCommunicatorTest, RejectsBadCallsWithoutCountingThem) {
  if (auto reason = MissingDevices(1)) GTEST_SKIP() << *reason;
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      MakeNcclCommunicator(NewStore(), "solo", 0, 1, 0);
  ASSERT_TRUE(made.ok()) << made.status();
  Communicator& solo = **made;

  torch::Tensor int32 = torch::ones({4}, torch::kInt32);
  absl::Status status = solo.AllReduce(int32, ReduceOp::kSum);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("dtype"), std::string::npos) << status;

  EXPECT_EQ(solo.ReduceScatter(torch::scalar_tensor(1.0, torch::kFloat32))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(solo.AllGather(torch::scalar_tensor(1.0, torch::kFloat32))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);

  torch::Tensor values = torch::ones({4}, torch::kFloat32);
  status = solo.Broadcast(values, /*root=*/1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("root"), std::string::npos) << status;
  status = solo.Send(values, /*dst=*/0);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("dst"), std::string::npos) << status;
  status = solo.Recv(values, /*src=*/0);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("src"), std::string::npos) << status;

  EXPECT_EQ(solo.stats().TotalCalls(), 0);
}

TEST(NcclCommunicatorTest, NonZeroRankWithoutPublishedIdFailsAtStoreTimeout) {
  if (auto reason = MissingDevices(1)) GTEST_SKIP() << *reason;
  c10::intrusive_ptr<c10d::Store> store = NewStore();
  store->setTimeout(std::chrono::milliseconds(200));
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      MakeNcclCommunicator(store, "nobody", /*rank=*/1, /*size=*/2, 0);
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("nobody/nccl_id"), std::string::npos)
      << made.status();
}

// Rank 0 of a pair whose rank 1 never comes: the rendezvous fails at the
// store's timeout, naming the missing rank, instead of blocking forever in
// ncclCommInitRank.
TEST(NcclCommunicatorTest, PeerThatNeverJoinsFailsAtStoreTimeout) {
  if (auto reason = MissingDevices(1)) GTEST_SKIP() << *reason;
  c10::intrusive_ptr<c10d::Store> store = NewStore();
  store->setTimeout(std::chrono::milliseconds(200));
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      MakeNcclCommunicator(store, "alone", /*rank=*/0, /*size=*/2, 0);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kDeadlineExceeded)
      << made.status();
  EXPECT_THAT(std::string(made.status().message()), HasSubstr("ranks {1}"));
}

// Everything one rank of the two-rank world saw, on the CPU.
struct RankResult {
  absl::Status status;
  int rank = -1;
  int size = -1;
  torch::Tensor sum;
  torch::Tensor bf16_sum;
  torch::Tensor max;
  torch::Tensor gathered;
  torch::Tensor scattered;
  torch::Tensor broadcast;
  torch::Tensor received;   // rank 1 only
  torch::Tensor exchanged;  // the peer's SumInput, by SendRecv
  CommStats stats;
};

torch::Tensor Bf16Input(int rank) {
  return RankValues(rank, 8, torch::kBFloat16);
}

// Runs every op as `rank` with its tensors on `place` (the CPU, or the rank's
// CUDA device).
absl::Status RunRank(c10::intrusive_ptr<c10d::Store> store, int rank,
                     torch::Device place, RankResult& result) {
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<Communicator> communicator,
      MakeNcclCommunicator(store, "pair", rank, /*size=*/2, /*device=*/rank));
  auto on = [&](const torch::Tensor& t) { return t.to(place); };
  result.rank = communicator->rank();
  result.size = communicator->size();
  result.sum = on(SumInput(rank));
  TALLY_RETURN_IF_ERROR(communicator->AllReduce(result.sum, ReduceOp::kSum));
  result.bf16_sum = on(Bf16Input(rank));
  TALLY_RETURN_IF_ERROR(
      communicator->AllReduce(result.bf16_sum, ReduceOp::kSum));
  result.max = on(MaxInput(rank));
  TALLY_RETURN_IF_ERROR(communicator->AllReduce(result.max, ReduceOp::kMax));
  TALLY_ASSIGN_OR_RETURN(result.gathered,
                         communicator->AllGather(on(GatherInput(rank))));
  TALLY_ASSIGN_OR_RETURN(result.scattered,
                         communicator->ReduceScatter(on(ScatterInput(rank))));
  result.broadcast = on(BroadcastInput(rank));
  TALLY_RETURN_IF_ERROR(communicator->Broadcast(result.broadcast, /*root=*/1));
  if (rank == 0) {
    TALLY_RETURN_IF_ERROR(communicator->Send(on(SendInput()), /*dst=*/1));
  } else {
    result.received = on(torch::zeros_like(SendInput()));
    TALLY_RETURN_IF_ERROR(communicator->Recv(result.received, /*src=*/0));
  }
  // Both ranks send first: only a fused send/recv cannot deadlock here.
  result.exchanged = on(torch::zeros_like(SumInput(1 - rank)));
  TALLY_RETURN_IF_ERROR(communicator->SendRecv(on(SumInput(rank)), 1 - rank,
                                               result.exchanged, 1 - rank));
  result.stats = communicator->stats();
  for (torch::Tensor* t :
       {&result.sum, &result.bf16_sum, &result.max, &result.gathered,
        &result.scattered, &result.broadcast, &result.received,
        &result.exchanged}) {
    if (t->defined()) {
      if (t->device() != place) {
        return absl::InternalError(absl::StrCat(
            "a result is on ", t->device().str(), ", not ", place.str()));
      }
      *t = t->cpu();
    }
  }
  return absl::OkStatus();
}

// CPU tensors (staged) always; CUDA tensors too with a CUDA LibTorch.
std::vector<bool> TensorPlacements() {
  std::vector<bool> on_cuda = {false};
  if (TALLY_TORCH_CUDA) on_cuda.push_back(true);
  return on_cuda;
}

TEST(NcclCommunicatorTest, TwoRanksOnTwoDevicesMatchHostReference) {
  if (auto reason = MissingDevices(2)) GTEST_SKIP() << *reason;
  for (const bool cuda_tensors : TensorPlacements()) {
    SCOPED_TRACE(cuda_tensors ? "CUDA tensors" : "CPU tensors");
    c10::intrusive_ptr<c10d::Store> store = NewStore();
    // A rank that fails early must not leave its peer waiting 5 minutes.
    store->setTimeout(std::chrono::seconds(60));
    std::vector<RankResult> results(2);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        const torch::Device place = cuda_tensors
                                        ? torch::Device(torch::kCUDA, rank)
                                        : torch::Device(torch::kCPU);
        results[rank].status = RunRank(store, rank, place, results[rank]);
      });
    }
    for (std::thread& thread : threads) thread.join();

    const torch::Tensor sum = SumInput(0) + SumInput(1);
    // Summed in float32, rounded to bfloat16 once.
    const torch::Tensor bf16_sum =
        (Bf16Input(0).to(torch::kFloat32) + Bf16Input(1).to(torch::kFloat32))
            .to(torch::kBFloat16);
    const torch::Tensor max = torch::max(MaxInput(0), MaxInput(1));
    const torch::Tensor gathered = torch::cat({GatherInput(0), GatherInput(1)});
    const torch::Tensor scatter_sum = ScatterInput(0) + ScatterInput(1);
    for (int rank = 0; rank < 2; ++rank) {
      SCOPED_TRACE(absl::StrCat("rank ", rank));
      const RankResult& result = results[rank];
      ASSERT_TRUE(result.status.ok()) << result.status;
      EXPECT_EQ(result.rank, rank);
      EXPECT_EQ(result.size, 2);
      EXPECT_TRUE(torch::equal(result.sum, sum)) << result.sum;
      EXPECT_TRUE(torch::equal(result.bf16_sum, bf16_sum)) << result.bf16_sum;
      EXPECT_TRUE(torch::equal(result.max, max)) << result.max;
      EXPECT_TRUE(torch::equal(result.gathered, gathered)) << result.gathered;
      EXPECT_TRUE(
          torch::equal(result.scattered, scatter_sum.narrow(0, 2 * rank, 2)))
          << result.scattered;
      EXPECT_TRUE(torch::equal(result.broadcast, BroadcastInput(1)))
          << result.broadcast;
      EXPECT_TRUE(torch::equal(result.exchanged, SumInput(1 - rank)))
          << result.exchanged;

      ExpectCounter(result.stats, CommOp::kAllReduce, 3,
                    12 * sizeof(float) + 8 * 2 + 6 * sizeof(int64_t));
      ExpectCounter(result.stats, CommOp::kAllGather, 1, 6 * sizeof(uint8_t));
      ExpectCounter(result.stats, CommOp::kReduceScatter, 1,
                    8 * sizeof(double));
      ExpectCounter(result.stats, CommOp::kBroadcast, 1, 5 * sizeof(int64_t));
      const size_t exchanged_bytes = SumInput(rank).nbytes();
      ExpectCounter(result.stats, CommOp::kSend, rank == 0 ? 2 : 1,
                    (rank == 0 ? 3 * sizeof(double) : 0) + exchanged_bytes);
      ExpectCounter(result.stats, CommOp::kRecv, rank == 1 ? 2 : 1,
                    (rank == 1 ? 3 * sizeof(double) : 0) + exchanged_bytes);
    }
    EXPECT_TRUE(torch::equal(results[1].received, SendInput()))
        << results[1].received;
  }
}

#if TALLY_TORCH_CUDA
torch::Tensor OnGpu(const torch::Tensor& t) {
  return t.to(torch::Device(torch::kCUDA, 0));
}

// In a world of one every op is the identity; what is checked is that CUDA
// tensors go in and come out on the device, in their dtype, with the values
// and counters of the CPU path.
TEST(NcclCudaTensorTest, WorldOfOneKeepsTensorsOnTheDevice) {
  if (auto reason = MissingDevices(1)) GTEST_SKIP() << *reason;
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      MakeNcclCommunicator(NewStore(), "solo", 0, 1, 0);
  ASSERT_TRUE(made.ok()) << made.status();
  Communicator& solo = **made;

  int64_t reduced_bytes = 0;
  for (const torch::Dtype dtype :
       {torch::kFloat32, torch::kFloat64, torch::kBFloat16}) {
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      SCOPED_TRACE(absl::StrCat(c10::toString(dtype),
                                op == ReduceOp::kSum ? " sum" : " max"));
      torch::Tensor t = OnGpu(RankValues(0, 12, dtype));
      ASSERT_TRUE(solo.AllReduce(t, op).ok());
      EXPECT_TRUE(t.is_cuda());
      EXPECT_EQ(t.scalar_type(), dtype);
      EXPECT_TRUE(torch::equal(t.cpu(), RankValues(0, 12, dtype)));
      reduced_bytes += t.nbytes();
    }
  }
  // A strided view comes back in its own layout.
  torch::Tensor base = OnGpu(torch::arange(12, torch::kInt64).reshape({3, 4}));
  torch::Tensor transposed = base.t();
  ASSERT_TRUE(solo.AllReduce(transposed, ReduceOp::kSum).ok());
  EXPECT_TRUE(torch::equal(base.cpu(),
                           torch::arange(12, torch::kInt64).reshape({3, 4})));
  reduced_bytes += transposed.nbytes();

  const torch::Tensor bf16 = RankValues(0, 6, torch::kBFloat16).reshape({2, 3});
  absl::StatusOr<torch::Tensor> gathered = solo.AllGather(OnGpu(bf16));
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  EXPECT_TRUE(gathered->is_cuda());
  EXPECT_EQ(gathered->scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(gathered->cpu(), bf16));

  for (const torch::Dtype dtype : {torch::kFloat64, torch::kBFloat16}) {
    const torch::Tensor input = ScatterInput(0).to(dtype);
    absl::StatusOr<torch::Tensor> scattered = solo.ReduceScatter(OnGpu(input));
    ASSERT_TRUE(scattered.ok()) << scattered.status();
    EXPECT_TRUE(scattered->is_cuda());
    EXPECT_EQ(scattered->scalar_type(), dtype);
    EXPECT_TRUE(torch::equal(scattered->cpu(), input));
  }

  torch::Tensor broadcast = OnGpu(BroadcastInput(0));
  ASSERT_TRUE(solo.Broadcast(broadcast, /*root=*/0).ok());
  EXPECT_TRUE(torch::equal(broadcast.cpu(), BroadcastInput(0)));

  // A CUDA tensor of another device than the communicator's is refused.
  if (!MissingDevices(2)) {
    torch::Tensor elsewhere = SumInput(0).to(torch::Device(torch::kCUDA, 1));
    const absl::Status status = solo.AllReduce(elsewhere, ReduceOp::kSum);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  }

  const CommStats& stats = solo.stats();
  ExpectCounter(stats, CommOp::kAllReduce, 7, reduced_bytes);
  ExpectCounter(stats, CommOp::kAllGather, 1, 6 * 2);
  ExpectCounter(stats, CommOp::kReduceScatter, 2, 8 * sizeof(double) + 8 * 2);
  ExpectCounter(stats, CommOp::kBroadcast, 1, 5 * sizeof(int64_t));
}

// Holds LibTorch's current stream in a host function until released: work
// ordered after it cannot start.
void CUDART_CB HoldStream(void* released) {
  while (!static_cast<std::atomic<bool>*>(released)->load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The op is ordered after LibTorch's held stream, so it cannot finish: past
// the timeout the communicator aborts and stays failed.
TEST(NcclCudaTensorTest, OpPastTheTimeoutAbortsTheCommunicator) {
  if (auto reason = MissingDevices(1)) GTEST_SKIP() << *reason;
  absl::StatusOr<std::unique_ptr<Communicator>> made = MakeNcclCommunicator(
      NewStore(), "stalled", 0, 1, 0, absl::Milliseconds(200));
  ASSERT_TRUE(made.ok()) << made.status();
  Communicator& solo = **made;

  torch::Tensor values = OnGpu(SumInput(0));
  const cudaStream_t torch_stream = c10::cuda::getCurrentCUDAStream(0).stream();
  std::atomic<bool> released{false};
  ASSERT_EQ(cudaLaunchHostFunc(torch_stream, &HoldStream, &released),
            cudaSuccess);
  // Released once the communicator has failed (NCCL's abort may itself wait
  // for the stream), or after a minute should it never fail.
  std::thread releaser([&] {
    for (int i = 0; i < 60000 && solo.failure().ok(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    released = true;
  });
  const absl::Status stalled = solo.AllReduce(values, ReduceOp::kSum);
  releaser.join();
  ASSERT_EQ(cudaStreamSynchronize(torch_stream), cudaSuccess);

  EXPECT_EQ(stalled.code(), absl::StatusCode::kDeadlineExceeded) << stalled;
  EXPECT_THAT(std::string(stalled.message()), HasSubstr("aborted"));
  EXPECT_EQ(solo.failure(), stalled);
  EXPECT_EQ(solo.AllReduce(values, ReduceOp::kSum), stalled);
}
#endif  // TALLY_TORCH_CUDA

}  // namespace
}  // namespace tally
