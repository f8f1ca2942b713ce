// Shared by the JSON file fuzzers: the invariant check that aborts (which
// libFuzzer reports with the input), and the deeply nested input every one
// of them is started with (LLVMFuzzerInitialize), too large for a corpus.
//
//   tally::fuzz::Require(status.message().size() <= tally::fuzz::kMaxMessage);
//   const std::string deep = tally::fuzz::Nested("{\"weight_map\":{\"a\":",
//                                                "}}", 100000);
#ifndef TALLY_TESTS_FUZZ_FUZZ_UTIL_H_
#define TALLY_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cstddef>
#include <cstdlib>
#include <string>

namespace tally {
namespace fuzz {

// An error message quotes at most short prefixes of the input, so it stays
// this short whatever the input's size.
inline constexpr size_t kMaxMessage = 1024;

inline void Require(bool invariant) {
  if (!invariant) abort();
}

// `head`, `depth` nested arrays, `tail`: JSON nested far deeper than
// nlohmann's recursive copy, compare and dump() can go.
inline std::string Nested(const std::string& head, const std::string& tail,
                          size_t depth) {
  return head + std::string(depth, '[') + std::string(depth, ']') + tail;
}

}  // namespace fuzz
}  // namespace tally

#endif  // TALLY_TESTS_FUZZ_FUZZ_UTIL_H_
