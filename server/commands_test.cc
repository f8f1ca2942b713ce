// The command table on rank 0 (server/commands.h): a command runs on the
// arguments its caller parsed once, before admission, and a request that the
// entry's parse refuses never reaches the engine.
#include "server/commands.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>

#include "tests/testing/test_util.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

class CommandRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = Engine::CreateSingleRank({}).value();
    ASSERT_TRUE(engine_
                    ->CreateModel(testing::TinySpec("m", DType::kFloat32,
                                                    OptimizerKind::kAdamW))
                    .ok());
  }

  // A ForwardBackward of model "m" on one sample whose `length` tokens all
  // count.
  static v1::ForwardBackwardRequest Request(int length) {
    v1::ForwardBackwardRequest request;
    request.set_model_id("m");
    v1::Sample* sample = request.add_samples();
    for (int t = 0; t < length; ++t) {
      sample->add_input_tokens(1);
      sample->add_target_tokens(2);
    }
    return request;
  }

  CommandRunner Runner() const {
    return CommandRunner(engine_->control(), *engine_, /*metrics=*/nullptr);
  }

  std::unique_ptr<Engine> engine_;
};

// The front end parses a request before admission and hands the result to
// the command: rank 0 executes those arguments and parses nothing again.
TEST_F(CommandRunnerTest, RunsOnTheArgumentsItIsGiven) {
  const ForwardBackwardArgs parsed =
      kForwardBackwardCommand.parse(Request(5)).value();
  v1::ForwardBackwardResponse response;
  ASSERT_TRUE(Runner()
                  .Run(kForwardBackwardCommand, Request(3), parsed, &response)
                  .ok());
  EXPECT_EQ(response.valid_tokens(), 5);
  EXPECT_EQ(engine_->GetModel("m")->window.tokens, 5);
}

// Without parsed arguments the runner parses the request itself; what the
// parse refuses is the error the front end answers before admission, and the
// engine never sees the call.
TEST_F(CommandRunnerTest, ARequestItsParseRefusesNeverRuns) {
  v1::ForwardBackwardRequest request = Request(4);
  request.set_loss_fn(v1::LOSS_FN_PPO);
  (*request.mutable_loss_fn_config())["clip_epsilon"] = 0.2;
  v1::ForwardBackwardResponse response;
  const absl::Status status =
      Runner().Run(kForwardBackwardCommand, request, &response);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("clip_epsilon"));
  EXPECT_EQ(status, kForwardBackwardCommand.parse(request).status());
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 0);

  request.set_loss_fn(v1::LOSS_FN_CROSS_ENTROPY);
  request.clear_loss_fn_config();
  ASSERT_TRUE(Runner().Run(kForwardBackwardCommand, request, &response).ok());
  EXPECT_EQ(engine_->GetModel("m")->window.calls, 1);
}

}  // namespace
}  // namespace tally
