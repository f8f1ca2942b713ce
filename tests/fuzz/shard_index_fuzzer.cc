// libFuzzer target: untrusted model.safetensors.index.json text through
// ParseShardIndex (runtime/io/shard_index.h), which a model created from a
// sharded HF directory reads. A refused index is DATA_LOSS with a short
// message; an accepted one names only plain files of its directory, each
// holding at least one tensor.
//
//   build/tests/fuzz/fuzzers-build/shard_index_fuzzer -runs=20000
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/io/shard_index.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr char kPath[] = "model.safetensors.index.json";

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::string deep =
      tally::fuzz::Nested("{\"weight_map\":{\"a\":", "}}", 100000);
  const absl::StatusOr<tally::ShardIndex> index =
      tally::ParseShardIndex(deep, kPath);
  tally::fuzz::Require(!index.ok() && index.status().message().size() <=
                                          tally::fuzz::kMaxMessage);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tally::fuzz::Require;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<tally::ShardIndex> index =
      tally::ParseShardIndex(text, kPath);
  if (!index.ok()) {
    Require(index.status().code() == absl::StatusCode::kDataLoss);
    Require(index.status().message().size() <= tally::fuzz::kMaxMessage);
    return 0;
  }
  for (const auto& [file, names] : *index) {
    Require(!file.empty() && file != "." && file != "..");
    Require(file.find('/') == std::string::npos);
    Require(!names.empty());
  }
  return 0;
}
