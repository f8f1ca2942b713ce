// The independent side of the decoding tests: greedy completions by
// tests/python/hf_reference.py (the HF-faithful PyTorch model, run under
// Debian's python3) from an HF model directory such as WriteWeightsExport
// writes.
//
//   if (!tally::testing::ReferencePythonAvailable()) GTEST_SKIP();
//   TALLY_ASSIGN_OR_RETURN(
//       std::vector<tally::testing::ReferenceDecode> reference,
//       tally::testing::ReferenceGreedy(dir, {{3, 17, 9}}, /*max_tokens=*/8,
//                                       "float32"));
//   EXPECT_EQ(decoded[0].tokens, reference[0].tokens);
#ifndef TALLY_TESTS_TESTING_HF_REFERENCE_H_
#define TALLY_TESTS_TESTING_HF_REFERENCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tally::testing {

// One prompt's greedy completion: the new tokens and each one's
// log-probability.
struct ReferenceDecode {
  std::vector<int64_t> tokens;
  std::vector<double> logprobs;
};

// Whether the python3 the reference runs under is installed.
bool ReferencePythonAvailable();

// The reference's greedy completions of `prompts` (max_tokens each) from the
// HF directory `model_dir`, computed in `dtype` ("float64" or "float32"),
// in order. INTERNAL with the script's output when it fails or prints
// something other than one JSON line per prompt.
absl::StatusOr<std::vector<ReferenceDecode>> ReferenceGreedy(
    const std::string& model_dir,
    const std::vector<std::vector<int64_t>>& prompts, int64_t max_tokens,
    const std::string& dtype);

}  // namespace tally::testing

#endif  // TALLY_TESTS_TESTING_HF_REFERENCE_H_
