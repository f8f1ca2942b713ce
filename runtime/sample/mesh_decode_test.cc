// The pieces of mesh decoding (runtime/sample/mesh_decode.h) that need no
// model mesh: how the sequences split over the data ranks, the gather of
// their variable-length results (three real rank processes, one of them
// without a sequence), the pipeline group check, and a decode stopped on
// rank 0 stopping every rank at the same step (real rank processes). The
// decoding itself on every mesh is tests/golden/decode_golden_test.cc's.
#include "runtime/sample/mesh_decode.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "base/status.h"
#include "runtime/parallel/distributed.h"
#include "runtime/sample/decode.h"
#include "runtime/sample/prompt_logprobs.h"
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

// Rank 0's DecodeControl: its stop says DEADLINE_EXCEEDED from its
// `stop_at`-th poll on (never with 0); it records every report.
struct RecordingControl {
  explicit RecordingControl(int stop_at) {
    control.stop = [this, stop_at] {
      ++polls;
      return stop_at > 0 && polls >= stop_at
                 ? absl::DeadlineExceededError("the deadline passed")
                 : absl::OkStatus();
    };
    control.on_progress = [this](const DecodeStats& stats) {
      reports.push_back(stats);
    };
  }
  DecodeControl control;
  int polls = 0;
  std::vector<DecodeStats> reports;
};

// One sequence over two data ranks (rank 1 has none, so it only joins the
// checks), as long as max_tokens: rank 0 learns at its third check that
// its caller gave up, and both ranks stop there; then the same ranks
// decode the same request to its end, as one rank alone does.
TEST(DecodeStopTest, EveryRankStopsAtTheStepRankZeroStopsAndGoesOn) {
  testing::RunOnRanks(2, [](const RankEnv& env) -> absl::Status {
    MeshShape shape;
    shape.dp_replicate = 2;
    TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(shape, env.rank));
    TALLY_ASSIGN_OR_RETURN(
        std::unique_ptr<ProcessGroups> groups,
        ProcessGroups::Create(env, mesh, absl::Seconds(60), absl::Seconds(60)));
    TALLY_ASSIGN_OR_RETURN(
        std::unique_ptr<CausalLm> model,
        CreateCausalLm(testing::TinyConfig(), DType::kFloat64, 7, {}));
    DecodeRequest request;
    request.prompts = {{1, 5, 9}};
    request.max_tokens = 4 * kStopCheckSteps;
    request.sampling.temperature = 1.0;
    request.seed = 3;
    const DecodeGroups mesh_groups{&groups->world(), nullptr, &groups->world()};
    RecordingControl stopping(/*stop_at=*/env.rank == 0 ? 3 : 0);
    {
      const ScopedDecodeControl installed(&stopping.control);
      const absl::Status stopped =
          Decode(*model, request, mesh_groups).status();
      EXPECT_EQ(stopped.code(), env.rank == 0
                                    ? absl::StatusCode::kDeadlineExceeded
                                    : absl::StatusCode::kCancelled)
          << stopped;
    }
    EXPECT_EQ(stopping.polls, 3);
    if (env.rank == 0) {
      // Checks at steps 0, 8 and 16: the last token chosen is the 17th,
      // then one final report with nothing left.
      EXPECT_EQ(static_cast<int64_t>(stopping.reports.size()),
                2 * kStopCheckSteps + 2);
      EXPECT_EQ(stopping.reports[0].step, 1);
      EXPECT_EQ(stopping.reports[0].active_sequences, 1);
      EXPECT_GT(stopping.reports[0].cache_bytes, 0);
      const DecodeStats& last_step =
          stopping.reports[stopping.reports.size() - 2];
      EXPECT_EQ(last_step.step, 2 * kStopCheckSteps + 1);
      EXPECT_TRUE(stopping.reports.back().done);
      EXPECT_EQ(stopping.reports.back().active_sequences, 0);
      EXPECT_EQ(stopping.reports.back().cache_bytes, 0);
    } else {
      // Rank 1 decodes nothing: a single final report.
      EXPECT_EQ(stopping.reports.size(), 1u);
    }
    RecordingControl going_on(/*stop_at=*/0);
    const ScopedDecodeControl installed(&going_on.control);
    TALLY_ASSIGN_OR_RETURN(std::vector<DecodedSequence> on_mesh,
                           Decode(*model, request, mesh_groups));
    const ScopedDecodeControl none(nullptr);
    TALLY_ASSIGN_OR_RETURN(std::vector<DecodedSequence> alone,
                           Decode(*model, request));
    EXPECT_EQ(going_on.polls, 5);  // steps 0, 8, 16, 24 and the end
    EXPECT_EQ(on_mesh.size(), 1u);
    EXPECT_EQ(on_mesh[0].tokens, alone[0].tokens);
    EXPECT_EQ(on_mesh[0].logprobs, alone[0].logprobs);
    EXPECT_EQ(static_cast<int64_t>(on_mesh[0].tokens.size()),
              request.max_tokens);
    return absl::OkStatus();
  });
}

// Prompt log-probabilities poll the stop every kStopCheckSteps prompts,
// and stop there.
TEST(DecodeStopTest, PromptLogprobsStopAtTheirNextCheck) {
  std::unique_ptr<CausalLm> model =
      CreateCausalLm(testing::TinyConfig(), DType::kFloat64, 7, {}).value();
  const std::vector<TokenIds> prompts(static_cast<size_t>(kStopCheckSteps + 1),
                                      TokenIds{1, 5, 9});
  RecordingControl stopping(/*stop_at=*/2);
  const ScopedDecodeControl installed(&stopping.control);
  const absl::Status stopped =
      ComputePromptLogprobs(*model, prompts, /*topk=*/2).status();
  EXPECT_EQ(stopped.code(), absl::StatusCode::kDeadlineExceeded) << stopped;
  EXPECT_EQ(stopping.polls, 2);  // before prompts 0 and 8
  RecordingControl going_on(/*stop_at=*/0);
  const ScopedDecodeControl replaced(&going_on.control);
  EXPECT_EQ(ComputePromptLogprobs(*model, prompts, /*topk=*/2).value().size(),
            prompts.size());
  EXPECT_EQ(going_on.polls, 2);
}

}  // namespace
}  // namespace tally
