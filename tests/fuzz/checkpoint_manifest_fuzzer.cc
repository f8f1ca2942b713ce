// libFuzzer target: untrusted tally.json text through
// ParseCheckpointManifest (runtime/checkpoint/checkpoint_manifest.h), which
// every read of a tally checkpoint (--resume, LoadCheckpoint, init_checkpoint)
// parses. A refused manifest is DATA_LOSS (INVALID_ARGUMENT for a newer
// format_version) with a short message; an accepted one survives
// ManifestToJson -> ParseCheckpointManifest unchanged.
//
//   build/tests/fuzz/fuzzers-build/checkpoint_manifest_fuzzer -runs=20000
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/checkpoint/checkpoint_manifest.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr char kPath[] = "tally.json";

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::string deep = tally::fuzz::Nested(
      "{\"format_version\":2,\"lora\":{\"rank\":", "}}", 100000);
  const absl::StatusOr<tally::CheckpointManifest> manifest =
      tally::ParseCheckpointManifest(deep, kPath);
  tally::fuzz::Require(!manifest.ok() && manifest.status().message().size() <=
                                             tally::fuzz::kMaxMessage);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tally::fuzz::Require;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<tally::CheckpointManifest> manifest =
      tally::ParseCheckpointManifest(text, kPath);
  if (!manifest.ok()) {
    Require(manifest.status().code() == absl::StatusCode::kDataLoss ||
            manifest.status().code() == absl::StatusCode::kInvalidArgument);
    Require(manifest.status().message().size() <= tally::fuzz::kMaxMessage);
    return 0;
  }
  const std::string written = tally::ManifestToJson(*manifest);
  const absl::StatusOr<tally::CheckpointManifest> again =
      tally::ParseCheckpointManifest(written, kPath);
  Require(again.ok() && tally::ManifestToJson(*again) == written);
  return 0;
}
