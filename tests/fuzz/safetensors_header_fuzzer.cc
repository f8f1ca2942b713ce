// libFuzzer target: untrusted safetensors bytes through the header parser
// (runtime/io/safetensors_header.h), everything ReadSafetensors checks before
// it reads tensor data. The input is a whole file: the 8-byte length prefix,
// the JSON header, then the data buffer. A header the parser accepts must
// describe tensors that tile the data buffer in bounds and without overlap,
// each exactly as long as its shape and dtype say, and must survive
// EncodeSafetensorsHeader -> parse unchanged.
//
//   build/tests/fuzz/fuzzers-build/safetensors_header_fuzzer -runs=20000
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/io/safetensors_header.h"

namespace tally {
namespace {

void Require(bool invariant) {
  if (!invariant) abort();
}

// Element count of the entry's shape, saturating at UINT64_MAX.
uint64_t CheckedNumel(const SafetensorsEntry& entry) {
  uint64_t numel = 1;
  for (int64_t d : entry.shape) {
    Require(d >= 0);
    const uint64_t dim = static_cast<uint64_t>(d);
    if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / dim) {
      return std::numeric_limits<uint64_t>::max();
    }
    numel *= dim;
  }
  return numel;
}

void CheckAccepted(const SafetensorsHeader& header, uint64_t file_size) {
  Require(header.data_start >= kSafetensorsLengthBytes);
  Require(header.data_start + header.data_size == file_size);
  uint64_t cursor = 0;
  for (const SafetensorsEntry& entry : header.tensors) {
    Require(entry.name != "__metadata__");
    Require(entry.begin == cursor);  // no gap, no overlap, ascending
    Require(entry.begin <= entry.end && entry.end <= header.data_size);
    const uint64_t numel = CheckedNumel(entry);
    const uint64_t itemsize = SafetensorsDTypeSize(entry.dtype);
    Require(numel <= std::numeric_limits<uint64_t>::max() / itemsize);
    Require(numel * itemsize == entry.end - entry.begin);
    cursor = entry.end;
  }
  Require(cursor == header.data_size);
}

// Encoding an accepted header and parsing it again gives the same header.
void CheckRoundTrip(const SafetensorsHeader& header) {
  const std::string encoded =
      EncodeSafetensorsHeader(header.tensors, header.metadata);
  const uint64_t file_size = encoded.size() + header.data_size;
  absl::StatusOr<uint64_t> length =
      ParseSafetensorsHeaderLength(encoded, file_size);
  Require(length.ok());
  Require(*length + kSafetensorsLengthBytes == encoded.size());
  Require(encoded.size() % 8 == 0);  // the data starts aligned
  absl::StatusOr<SafetensorsHeader> again = ParseSafetensorsHeader(
      absl::string_view(encoded).substr(kSafetensorsLengthBytes), file_size);
  Require(again.ok());
  Require(again->data_size == header.data_size);
  Require(again->tensors == header.tensors);
  Require(again->metadata == header.metadata);
}

}  // namespace
}  // namespace tally

// A regression input too large for the corpus: a shape nested deeper than
// nlohmann's recursive copy and dump() can go.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  constexpr size_t kDepth = 200000;
  const std::string header =
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[" + std::string(kDepth, '[') +
      std::string(kDepth, ']') + "],\"data_offsets\":[0,0]}}";
  tally::Require(
      !tally::ParseSafetensorsHeader(header, 8 + header.size()).ok());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tally;
  const absl::string_view file(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<uint64_t> length = ParseSafetensorsHeaderLength(file, size);
  if (!length.ok()) return 0;
  Require(*length <= size - kSafetensorsLengthBytes);
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensorsHeader(
      file.substr(kSafetensorsLengthBytes, *length), size);
  if (!header.ok()) return 0;
  CheckAccepted(*header, size);
  CheckRoundTrip(*header);
  return 0;
}
