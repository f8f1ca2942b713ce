// Multi-process tests: run a test body in real rank processes that
// rendezvous on loopback, each a re-execution of the current test binary
// filtered to the current test ("self-launching gtest").
//
//   TEST(DistributedTest, WorldAllReduce) {
//     tally::testing::RunOnRanks(4, [](const tally::RankEnv& env) {
//       TALLY_ASSIGN_OR_RETURN(tally::Mesh mesh,
//                              tally::Mesh::Create(shape, env.rank));
//       TALLY_ASSIGN_OR_RETURN(
//           auto groups,
//           tally::ProcessGroups::Create(env, mesh, absl::Seconds(30)));
//       ...
//       EXPECT_EQ(...);  // gtest failures in a rank fail the test too
//       return absl::OkStatus();
//     });
//   }
//
// In the launching process RunOnRanks starts `world_size` children, waits
// for them and reports every failing rank with its captured output. In a
// child (TALLY_TEST_RANK set) it runs `body` as that rank and exits the
// process: 0 when the body returns OK without gtest failures, 1 otherwise.
// A TEST may call RunOnRanks several times; each call gets its own children.
#ifndef TALLY_TESTS_TESTING_MULTIRANK_H_
#define TALLY_TESTS_TESTING_MULTIRANK_H_

#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/mesh.h"

namespace tally::testing {

using RankBody = std::function<absl::Status(const RankEnv& env)>;

// Fails the current test when a rank fails, or when the ranks are not all
// done within `timeout` (all are then killed). Once one rank fails, the
// others get a short grace period before they are killed, so a rank stuck
// in a collective with the dead one does not hold the test until `timeout`.
void RunOnRanks(int world_size, const RankBody& body,
                absl::Duration timeout = absl::Seconds(120));

// A TCP port that was free on every interface a moment ago.
int PickFreePort();

// The mesh of these sizes per dimension (its world size their product).
MeshShape Shape(int dp_replicate, int dp_shard, int tp, int cp = 1, int ep = 1,
                int pp = 1);

}  // namespace tally::testing

#endif  // TALLY_TESTS_TESTING_MULTIRANK_H_
