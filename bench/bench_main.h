// The main() of a bench binary: parse the options, run, and report a failure
// under the bench's name with exit code 1.
//
//   int main(int argc, char** argv) {
//     return tally::BenchMain("bench_rpc", tally::ParseOptions(argc, argv),
//                             tally::Run);
//   }
#ifndef TALLY_BENCH_BENCH_MAIN_H_
#define TALLY_BENCH_BENCH_MAIN_H_

#include <iostream>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tally {

template <typename Options>
int BenchMain(const char* name, const absl::StatusOr<Options>& options,
              absl::Status (*run)(const Options&)) {
  absl::Status status = options.status();
  if (status.ok()) status = run(*options);
  if (!status.ok()) {
    std::cerr << name << ": " << status << "\n";
    return 1;
  }
  return 0;
}

}  // namespace tally

#endif  // TALLY_BENCH_BENCH_MAIN_H_
