#include "runtime/cuda/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

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
#include "base/status.h"

namespace tally {
namespace {

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
  };
  const std::vector<Case> cases = {
      {c10::intrusive_ptr<c10d::Store>(), 0, 1, 0, "store"},
      {NewStore(), 0, 0, 0, "size"},
      {NewStore(), -1, 2, 0, "rank"},
      {NewStore(), 2, 2, 0, "rank"},
      {NewStore(), 0, 1, -1, "device"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::unique_ptr<Communicator>> communicator =
        MakeNcclCommunicator(c.store, "args", c.rank, c.size, c.device);
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

// Everything one rank of the two-rank world saw.
struct RankResult {
  absl::Status status;
  int rank = -1;
  int size = -1;
  torch::Tensor sum;
  torch::Tensor max;
  torch::Tensor gathered;
  torch::Tensor scattered;
  torch::Tensor broadcast;
  torch::Tensor received;   // rank 1 only
  torch::Tensor exchanged;  // the peer's SumInput, by SendRecv
  CommStats stats;
};

absl::Status RunRank(c10::intrusive_ptr<c10d::Store> store, int rank,
                     RankResult& result) {
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<Communicator> communicator,
      MakeNcclCommunicator(store, "pair", rank, /*size=*/2, /*device=*/rank));
  result.rank = communicator->rank();
  result.size = communicator->size();
  result.sum = SumInput(rank);
  TALLY_RETURN_IF_ERROR(communicator->AllReduce(result.sum, ReduceOp::kSum));
  result.max = MaxInput(rank);
  TALLY_RETURN_IF_ERROR(communicator->AllReduce(result.max, ReduceOp::kMax));
  TALLY_ASSIGN_OR_RETURN(result.gathered,
                         communicator->AllGather(GatherInput(rank)));
  TALLY_ASSIGN_OR_RETURN(result.scattered,
                         communicator->ReduceScatter(ScatterInput(rank)));
  result.broadcast = BroadcastInput(rank);
  TALLY_RETURN_IF_ERROR(communicator->Broadcast(result.broadcast, /*root=*/1));
  if (rank == 0) {
    TALLY_RETURN_IF_ERROR(communicator->Send(SendInput(), /*dst=*/1));
  } else {
    result.received = torch::zeros_like(SendInput());
    TALLY_RETURN_IF_ERROR(communicator->Recv(result.received, /*src=*/0));
  }
  // Both ranks send first: only a fused send/recv cannot deadlock here.
  result.exchanged = torch::zeros_like(SumInput(1 - rank));
  TALLY_RETURN_IF_ERROR(communicator->SendRecv(SumInput(rank), 1 - rank,
                                               result.exchanged, 1 - rank));
  result.stats = communicator->stats();
  return absl::OkStatus();
}

TEST(NcclCommunicatorTest, TwoRanksOnTwoDevicesMatchHostReference) {
  if (auto reason = MissingDevices(2)) GTEST_SKIP() << *reason;
  c10::intrusive_ptr<c10d::Store> store = NewStore();
  // A rank that fails early must not leave its peer waiting 5 minutes.
  store->setTimeout(std::chrono::seconds(60));
  std::vector<RankResult> results(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      results[rank].status = RunRank(store, rank, results[rank]);
    });
  }
  for (std::thread& thread : threads) thread.join();

  const torch::Tensor sum = SumInput(0) + SumInput(1);
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
    EXPECT_TRUE(torch::equal(result.max, max)) << result.max;
    EXPECT_TRUE(torch::equal(result.gathered, gathered)) << result.gathered;
    EXPECT_TRUE(
        torch::equal(result.scattered, scatter_sum.narrow(0, 2 * rank, 2)))
        << result.scattered;
    EXPECT_TRUE(torch::equal(result.broadcast, BroadcastInput(1)))
        << result.broadcast;
    EXPECT_TRUE(torch::equal(result.exchanged, SumInput(1 - rank)))
        << result.exchanged;

    ExpectCounter(result.stats, CommOp::kAllReduce, 2,
                  12 * sizeof(float) + 6 * sizeof(int64_t));
    ExpectCounter(result.stats, CommOp::kAllGather, 1, 6 * sizeof(uint8_t));
    ExpectCounter(result.stats, CommOp::kReduceScatter, 1, 8 * sizeof(double));
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

}  // namespace
}  // namespace tally
