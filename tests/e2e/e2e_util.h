// Helpers shared by the end-to-end tests (header-only: tests/e2e/*_test.cc
// each build into their own binary).
#ifndef TALLY_TESTS_E2E_E2E_UTIL_H_
#define TALLY_TESTS_E2E_E2E_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tally/v1/trainer.pb.h"
#include "tests/e2e/server_process.h"

// ASSERTs that `expr` (an absl::StatusOr) is OK, then moves its value into
// `lhs`.
#define TALLY_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  TALLY_ASSERT_OK_AND_ASSIGN_IMPL_(           \
      TALLY_E2E_CONCAT_(tally_assert_statusor_, __LINE__), lhs, expr)
#define TALLY_E2E_CONCAT_(a, b) TALLY_E2E_CONCAT_INNER_(a, b)
#define TALLY_E2E_CONCAT_INNER_(a, b) a##b
#define TALLY_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                     \
  ASSERT_TRUE(statusor.ok()) << statusor.status();            \
  lhs = std::move(statusor).value()

namespace tally::testing {

inline constexpr int32_t kIgnoredTarget = -100;

// What the proto calls valid: a real target and a positive weight.
inline int64_t ValidTokens(const v1::Sample& sample) {
  int64_t valid = 0;
  for (int i = 0; i < sample.target_tokens_size(); ++i) {
    const bool weighted = sample.weights_size() == 0 || sample.weights(i) > 0;
    if (sample.target_tokens(i) != kIgnoredTarget && weighted) ++valid;
  }
  return valid;
}

// Starts the server under test with `args` and adds it to `servers`; nullptr,
// with the failure recorded, when it does not come up.
inline ServerProcess* StartServerOrFail(
    const std::vector<std::string>& args,
    std::vector<std::unique_ptr<ServerProcess>>& servers) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> started =
      ServerProcess::Start(ServerBinaryFromEnv(), args);
  if (!started.ok()) {
    ADD_FAILURE() << started.status();
    return nullptr;
  }
  servers.push_back(*std::move(started));
  return servers.back().get();
}

// SIGTERMs every server and expects each to exit 0 within `timeout`.
inline void ExpectCleanShutdown(
    const std::vector<std::unique_ptr<ServerProcess>>& servers,
    absl::Duration timeout) {
  for (const std::unique_ptr<ServerProcess>& server : servers) {
    const absl::StatusOr<int> exit_code = server->Stop(timeout);
    EXPECT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(exit_code.value_or(-1), 0) << server->ReadLog();
  }
}

}  // namespace tally::testing

#endif  // TALLY_TESTS_E2E_E2E_UTIL_H_
