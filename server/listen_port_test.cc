#include "server/listen_port.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/held_port.h"

namespace tally {
namespace {

using ::tally::testing::HeldPort;
using ::testing::HasSubstr;

TEST(ListenPortTest, APortAnotherSocketListensOnIsRefusedNamingTheFlag) {
  HeldPort held;
  ASSERT_GT(held.port(), 0);
  for (const char* flag : {"--grpc-port", "--metrics-port"}) {
    const absl::Status status = CheckCanListen("127.0.0.1", held.port(), flag);
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat(
                    flag, ": cannot listen on 127.0.0.1:", held.port(),
                    ": Address already in use")));
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat("choose another ", flag)));
  }
  // The wildcard address covers 127.0.0.1 too.
  EXPECT_EQ(CheckCanListen("0.0.0.0", held.port(), "--grpc-port").code(),
            absl::StatusCode::kUnavailable);
}

TEST(ListenPortTest, PortZeroIsAlwaysFree) {
  EXPECT_TRUE(CheckCanListen("127.0.0.1", 0, "--grpc-port").ok());
}

TEST(ListenPortTest, ASocketThatDoesNotListenDoesNotTakeThePort) {
  // Bound with SO_REUSEADDR and not listening, as sockets of connections
  // that are closing are: gRPC and CivetServer (SO_REUSEADDR) can listen.
  HeldPort held(/*listen=*/false);
  ASSERT_GT(held.port(), 0);
  EXPECT_TRUE(CheckCanListen("127.0.0.1", held.port(), "--grpc-port").ok());
}

}  // namespace
}  // namespace tally
