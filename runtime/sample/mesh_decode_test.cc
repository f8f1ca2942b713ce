// The pieces of mesh decoding (runtime/sample/mesh_decode.h) that need no
// model mesh: how the sequences split over the data ranks, the gather of
// their variable-length results (three real rank processes, one of them
// without a sequence), and the pipeline group check. The decoding itself on
// every mesh is tests/golden/decode_golden_test.cc's.
#include "runtime/sample/mesh_decode.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "base/status.h"
#include "runtime/parallel/distributed.h"
#include "tests/testing/multirank.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

TEST(SequenceBlockTest, ContiguousBlocksCoverEverySequenceOnce) {
  for (int64_t count : {1, 2, 5, 8}) {
    for (int size : {1, 2, 3, 4}) {
      int64_t next = 0, shortest = count, longest = 0;
      for (int rank = 0; rank < size; ++rank) {
        const SequenceBlock block = SequenceBlockOf(count, rank, size);
        EXPECT_EQ(block.begin, next) << count << " over " << size;
        EXPECT_GE(block.end, block.begin);
        next = block.end;
        shortest = std::min(shortest, block.end - block.begin);
        longest = std::max(longest, block.end - block.begin);
      }
      EXPECT_EQ(next, count) << count << " over " << size;
      EXPECT_LE(longest - shortest, 1) << count << " over " << size;
    }
  }
  // The first ranks take the longer blocks.
  EXPECT_EQ(SequenceBlockOf(5, 0, 2).end, 3);
  EXPECT_EQ(SequenceBlockOf(1, 1, 2).begin, SequenceBlockOf(1, 1, 2).end);
}

// Sequence i of a call: 1 + (i % 3) tokens, stopped when i is odd, with
// log-probabilities that need every bit of a double.
DecodedSequence Made(int64_t i) {
  DecodedSequence sequence;
  for (int64_t t = 0; t <= i % 3; ++t) {
    sequence.tokens.push_back(1000 * i + t);
    sequence.logprobs.push_back(-1.0 / (3.0 + i + t));
  }
  sequence.stop_reason = i % 2 == 1 ? StopReason::kStop : StopReason::kLength;
  return sequence;
}

void ExpectAllSequences(const std::vector<DecodedSequence>& got,
                        int64_t count) {
  ASSERT_EQ(static_cast<int64_t>(got.size()), count);
  for (int64_t i = 0; i < count; ++i) {
    const DecodedSequence want = Made(i);
    EXPECT_EQ(got[i].tokens, want.tokens) << i;
    EXPECT_EQ(got[i].logprobs, want.logprobs) << i;  // bitwise
    EXPECT_EQ(got[i].stop_reason, want.stop_reason) << i;
  }
}

// Two sequences over three data ranks: rank 2 has none, and the blocks'
// packed lengths differ.
TEST(GatherDecodedTest, EveryRankGetsEverySequenceInOrder) {
  testing::RunOnRanks(3, [](const RankEnv& env) -> absl::Status {
    MeshShape shape;
    shape.dp_replicate = 3;
    TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
    TALLY_ASSIGN_OR_RETURN(
        std::unique_ptr<ProcessGroups> groups,
        ProcessGroups::Create(env, mesh, absl::Seconds(60), absl::Seconds(60)));
    constexpr int64_t kCount = 2;
    const SequenceBlock block = SequenceBlockOf(kCount, env.rank, 3);
    std::vector<DecodedSequence> local;
    for (int64_t i = block.begin; i < block.end; ++i) local.push_back(Made(i));
    TALLY_ASSIGN_OR_RETURN(
        std::vector<DecodedSequence> all,
        GatherDecoded(local, kCount, groups->world(), torch::kCPU));
    ExpectAllSequences(all, kCount);
    return absl::OkStatus();
  });
}

TEST(GatherDecodedTest, OneRankKeepsItsOwn) {
  std::unique_ptr<Communicator> one = MakeSingleRankCommunicator().value();
  std::vector<DecodedSequence> local = {Made(0), Made(1), Made(2)};
  ExpectAllSequences(GatherDecoded(local, 3, *one, torch::kCPU).value(), 3);
}

TEST(MeshStepTest, APipelineStageNeedsItsPipeline) {
  ModelSharding stage;
  stage.pp_stage = 1;
  stage.pp_stages = 2;
  std::unique_ptr<CausalLm> model =
      CreateCausalLm(testing::TinyConfig(), DType::kFloat64, 7, stage).value();
  EXPECT_EQ(MeshStep::Create(*model, {}).status().code(),
            absl::StatusCode::kUnimplemented);
  std::unique_ptr<Communicator> one = MakeSingleRankCommunicator().value();
  const absl::Status wrong =
      MeshStep::Create(*model, {nullptr, one.get()}).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.message().find("groups.pp"), absl::string_view::npos);
}

}  // namespace
}  // namespace tally
