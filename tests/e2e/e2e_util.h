// Helpers shared by the end-to-end tests (header-only: tests/e2e/*_test.cc
// each build into their own binary).
#ifndef TALLY_TESTS_E2E_E2E_UTIL_H_
#define TALLY_TESTS_E2E_E2E_UTIL_H_

#include <cstdint>
#include <utility>

#include "gtest/gtest.h"
#include "tally/v1/trainer.pb.h"

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

}  // namespace tally::testing

#endif  // TALLY_TESTS_E2E_E2E_UTIL_H_
