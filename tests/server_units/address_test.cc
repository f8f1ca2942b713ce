// IsLoopbackHost: loopback addresses only, parsed as addresses; names that
// merely start like one are not loopback.
#include "runtime/config/address.h"

#include <gtest/gtest.h>

namespace tally {
namespace {

TEST(AddressTest, LoopbackAddressesOnly) {
  for (const char* host : {"localhost", "127.0.0.1", "127.255.3.4", "::1",
                           "[::1]", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  for (const char* host :
       {"127.evil.example", "127.0.0.1.nip.io", "127.", "127", "0.0.0.0",
        "10.0.0.1", "128.0.0.1", "::", "::2", "[::1", "::ffff:10.0.0.1",
        "localhost.example", "LOCALHOST.evil", "", "1.127.0.0"}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
}

}  // namespace
}  // namespace tally
