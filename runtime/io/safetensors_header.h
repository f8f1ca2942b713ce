// SafetensorsHeader: the untrusted part of a safetensors file, parsed and
// validated without LibTorch, so the reader's checks can be fuzzed and
// unit-tested on their own (runtime/io/safetensors.h reads and writes the
// tensors themselves).
//
// A file is an 8-byte little-endian u64 N, N bytes of JSON header, then the
// data buffer. Parsing checks everything the header claims about the data
// before a byte of it is read: known dtypes, shapes whose element count times
// the dtype size equals the tensor's data_offsets span, offsets inside the
// data buffer, and tensors tiling it exactly (no gap, no overlap). Every
// failure is DATA_LOSS naming the tensor or field; the caller adds the file.
//
//   TALLY_ASSIGN_OR_RETURN(
//       uint64_t header_size,
//       tally::ParseSafetensorsHeaderLength(first_8_bytes, file_size));
//   // ... read header_size bytes at offset 8 into `text` ...
//   TALLY_ASSIGN_OR_RETURN(tally::SafetensorsHeader header,
//                          tally::ParseSafetensorsHeader(text, file_size));
//   for (const tally::SafetensorsEntry& e : header.tensors) {
//     // e.end - e.begin bytes at header.data_start + e.begin
//   }
#ifndef TALLY_RUNTIME_IO_SAFETENSORS_HEADER_H_
#define TALLY_RUNTIME_IO_SAFETENSORS_HEADER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

// The length prefix's size, and the reference implementation's limit on the
// header: a longer one means a corrupt length prefix, not a real file.
inline constexpr uint64_t kSafetensorsLengthBytes = 8;
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = uint64_t{100} << 20;

// The dtypes tally reads and writes.
enum class SafetensorsDType { kF32, kF64, kF16, kBF16, kI64, kI32 };

// "F32", "BF16", ...
const char* SafetensorsDTypeCode(SafetensorsDType dtype);
// nullopt for a code tally does not support.
std::optional<SafetensorsDType> SafetensorsDTypeFromCode(
    absl::string_view code);
// Bytes per element.
size_t SafetensorsDTypeSize(SafetensorsDType dtype);

// One tensor of the header.
struct SafetensorsEntry {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;  // every dimension in [0, INT64_MAX]
  // Byte range in the data buffer, relative to its start.
  uint64_t begin = 0;
  uint64_t end = 0;

  bool operator==(const SafetensorsEntry& other) const;
};

struct SafetensorsHeader {
  // The data buffer: file bytes [data_start, data_start + data_size).
  uint64_t data_start = 0;
  uint64_t data_size = 0;
  // In data layout order (ascending offsets; empty tensors sharing an offset
  // in header order). Consecutive entries touch: tensors[0].begin == 0,
  // tensors[i].begin == tensors[i - 1].end, and the last ends at data_size.
  std::vector<SafetensorsEntry> tensors;
  // The "__metadata__" map.
  std::map<std::string, std::string> metadata;
};

// The header length from a file's first bytes (`prefix`, at least the 8 of
// the length when the file has them): DATA_LOSS when the file is too short
// or the length does not fit the `file_size`-byte file or exceeds
// kSafetensorsMaxHeaderBytes.
absl::StatusOr<uint64_t> ParseSafetensorsHeaderLength(absl::string_view prefix,
                                                      uint64_t file_size);

// Parses and validates the JSON header `text` of a `file_size`-byte file
// whose length prefix said text.size(). DATA_LOSS naming the tensor (or
// "__metadata__") for anything malformed.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view text,
                                                         uint64_t file_size);

// The length prefix and JSON header of a file holding `tensors` (in that
// order, with their data_offsets as given) and `metadata` (omitted when
// empty), padded with spaces so the data starts 8-byte aligned. The caller
// checks the names (unique, not "__metadata__"); a name or metadata string
// that is not valid UTF-8 throws nlohmann::json::type_error.
std::string EncodeSafetensorsHeader(
    const std::vector<SafetensorsEntry>& tensors,
    const std::map<std::string, std::string>& metadata);

}  // namespace tally

#endif  // TALLY_RUNTIME_IO_SAFETENSORS_HEADER_H_
