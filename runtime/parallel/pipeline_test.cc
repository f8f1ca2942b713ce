// Unit tests of the stage split and the 1F1B order
// (runtime/parallel/pipeline.h).
#include "runtime/parallel/pipeline.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace tally {
namespace {

TEST(PipelineTest, StagesCoverTheLayersContiguouslyFirstStagesLonger) {
  for (int64_t layers : {1, 4, 7, 10}) {
    for (int stages = 1; stages <= layers; ++stages) {
      int64_t next = 0;
      for (int s = 0; s < stages; ++s) {
        const LayerRange r = StageLayers(layers, s, stages);
        EXPECT_EQ(r.begin, next);
        const int64_t size = r.end - r.begin;
        // Sizes differ by at most one, the longer ones first.
        EXPECT_TRUE(size == layers / stages || size == layers / stages + 1);
        if (s > 0) {
          const LayerRange prev = StageLayers(layers, s - 1, stages);
          EXPECT_GE(prev.end - prev.begin, size);
        }
        next = r.end;
      }
      EXPECT_EQ(next, layers);
    }
  }
  EXPECT_EQ(StageLayers(7, 2, 3).begin, 5);  // 3, 2, 2
}

// Every micro-batch goes forward then backward exactly once, backwards in
// order, and a stage never holds more than stages - stage in flight.
TEST(PipelineTest, OneForwardOneBackwardOrder) {
  for (int stages = 1; stages <= 4; ++stages) {
    for (int m = 1; m <= 6; ++m) {
      for (int s = 0; s < stages; ++s) {
        std::set<int> in_flight;
        int forwards = 0, backwards = 0;
        size_t most = 0;
        for (const PipelineStep& step : OneForwardOneBackward(s, stages, m)) {
          if (step.forward) {
            EXPECT_EQ(step.micro_batch, forwards++);
            in_flight.insert(step.micro_batch);
          } else {
            EXPECT_EQ(step.micro_batch, backwards++);
            EXPECT_EQ(in_flight.erase(step.micro_batch), 1u);
          }
          most = std::max(most, in_flight.size());
        }
        EXPECT_EQ(forwards, m);
        EXPECT_EQ(backwards, m);
        EXPECT_EQ(most, static_cast<size_t>(std::min(stages - s, m)));
      }
    }
  }
}

TEST(PipelineTest, SplitContiguous) {
  EXPECT_EQ(SplitContiguous({1, 2, 3, 4, 5}, 2),
            (std::vector<std::vector<int>>{{1, 2, 3}, {4, 5}}));
  EXPECT_EQ(SplitContiguous({7}, 3), (std::vector<std::vector<int>>{{7}}));
  EXPECT_TRUE(SplitContiguous({}, 2).empty());
}

}  // namespace
}  // namespace tally
