// ProgressWatch: /readyz's view of a command that stopped progressing.
#include "server/progress_watch.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace tally {
namespace {

using ::testing::HasSubstr;

class ProgressWatchTest : public ::testing::Test {
 protected:
  absl::Time now_ = absl::UnixEpoch();
  ProgressWatch watch_{absl::Seconds(5), [this] { return now_; }};
};

TEST_F(ProgressWatchTest, ACommandRunningPastTheLimitIsNoProgress) {
  EXPECT_TRUE(watch_.Check().ok());
  {
    ProgressWatch::Scope running(&watch_);
    now_ += absl::Seconds(5);
    EXPECT_TRUE(watch_.Check().ok());  // up to the limit
    now_ += absl::Milliseconds(1);
    const absl::Status hung = watch_.Check();
    EXPECT_EQ(hung.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(hung.message()), HasSubstr("5.001s"));
    EXPECT_THAT(std::string(hung.message()),
                HasSubstr("collective timeout (5s)"));
  }
  EXPECT_TRUE(watch_.Check().ok());  // it ended
}

TEST_F(ProgressWatchTest, IdleTimeNeverCountsAndEachCommandStartsAfresh) {
  now_ += absl::Hours(1);  // idle
  EXPECT_TRUE(watch_.Check().ok());
  for (int i = 0; i < 3; ++i) {
    ProgressWatch::Scope running(&watch_);
    now_ += absl::Seconds(4);
    EXPECT_TRUE(watch_.Check().ok()) << "command " << i;
  }
  ProgressWatch::Scope nothing(nullptr);  // no watch: no effect
  EXPECT_TRUE(watch_.Check().ok());
}

TEST_F(ProgressWatchTest, ANestedScopeKeepsTheOuterCommandsStart) {
  ProgressWatch::Scope outer(&watch_);
  now_ += absl::Seconds(3);
  { ProgressWatch::Scope inner(&watch_); }
  now_ += absl::Seconds(3);
  EXPECT_EQ(watch_.Check().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tally
