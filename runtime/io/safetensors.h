// Safetensors: tally's own reader and writer for the HF safetensors format,
// so checkpoints load in PyTorch / transformers and HF weights load in tally.
//
// Layout: an 8-byte little-endian u64 N, N bytes of JSON header
//   {"__metadata__": {"format": "pt"},
//    "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...}
// padded with spaces so the data starts 8-byte aligned, then the raw
// little-endian tensor bytes; data_offsets are relative to the data start and
// the tensors tile it exactly (no gaps, no overlap), as the reference
// implementation requires. Parsing and validating the header (untrusted
// bytes, no LibTorch) is runtime/io/safetensors_header.h.
//
//   tally::NamedTensors tensors = {{"w", torch::ones({2, 3})}};
//   TALLY_RETURN_IF_ERROR(
//       tally::WriteSafetensors(path, tensors, {{"format", "pt"}}));
//   TALLY_ASSIGN_OR_RETURN(tally::NamedTensors read,
//                          tally::ReadSafetensors(path));
//   // Refusing, before allocating, any tensor but a [2, 3] "w":
//   auto screen = [](const tally::SafetensorsEntry& e)
//       -> absl::StatusOr<tally::ScreenVerdict> {
//     if (e.name == "w" && e.shape == std::vector<int64_t>{2, 3}) {
//       return tally::ScreenVerdict::kRead;
//     }
//     return absl::InvalidArgumentError("unexpected tensor " + e.name);
//   };
//   TALLY_ASSIGN_OR_RETURN(read,
//                          tally::ReadSafetensors(path, nullptr, screen));
#ifndef TALLY_RUNTIME_IO_SAFETENSORS_H_
#define TALLY_RUNTIME_IO_SAFETENSORS_H_

#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/io/safetensors_header.h"

namespace tally {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// The bytes of a safetensors file, ready to write: the length prefix and
// header, then the tensors' memory (contiguous CPU copies it keeps alive).
struct SerializedSafetensors {
  std::string prefix_and_header;
  std::vector<torch::Tensor> tensors;

  // The file's contents in order, viewing this object's memory.
  std::vector<absl::string_view> Pieces() const;
};

// Lays out `tensors` in the given order. Supported dtypes: F32, F64, F16,
// BF16, I64, I32; any other dtype or a repeated name is INVALID_ARGUMENT
// naming the tensor.
absl::StatusOr<SerializedSafetensors> SerializeSafetensors(
    const NamedTensors& tensors,
    const std::map<std::string, std::string>& metadata = {});

// SerializeSafetensors, written atomically (see WriteFileAtomically).
absl::Status WriteSafetensors(
    const std::string& path, const NamedTensors& tensors,
    const std::map<std::string, std::string>& metadata = {});

// What a reader does with a tensor the header declares, decided from the
// header alone (name, dtype, shape), before any memory for it exists: read
// it, leave it unread, or refuse the file with the screen's status (which
// should name the tensor and what was expected).
enum class ScreenVerdict { kRead, kSkip };
using SafetensorsScreen =
    std::function<absl::StatusOr<ScreenVerdict>(const SafetensorsEntry&)>;

// Reads the tensors in data layout order (so a file WriteSafetensors wrote
// reads back in its written order), into fresh CPU tensors that own their
// memory. A missing file is NOT_FOUND; a malformed or truncated one
// (bad header length, bad JSON, unknown dtype, offsets out of range,
// overlapping or leaving gaps, byte span not matching the shape) is DATA_LOSS
// naming the file and the tensor. `metadata`, when given, receives the
// "__metadata__" map. `screen`, when given, sees every tensor of the header
// before the first is allocated: the tensors it skips are not read, and its
// first error is returned, prefixed with the file, with nothing allocated.
absl::StatusOr<NamedTensors> ReadSafetensors(
    const std::string& path,
    std::map<std::string, std::string>* metadata = nullptr,
    const SafetensorsScreen& screen = nullptr);

// Writes the concatenation of `pieces` to `path` (created or truncated) and
// fsyncs it, without renaming: for files inside a directory that is published
// as a whole. Returns the SHA-256 of the bytes written, as lowercase hex.
absl::StatusOr<std::string> WriteFileDurably(
    const std::string& path, const std::vector<absl::string_view>& pieces);

// Writes the concatenation of `pieces` to `path + ".tmp"`, fsyncs it, renames
// it over `path` and fsyncs the directory, so a crash leaves either the old
// file or the complete new one.
absl::Status WriteFileAtomically(const std::string& path,
                                 const std::vector<absl::string_view>& pieces);

// fsyncs the directory `dir`, making renames and creations in it durable.
absl::Status SyncDirectory(const std::string& dir);

// SHA-256 of the file's contents, as lowercase hex; NOT_FOUND when missing.
absl::StatusOr<std::string> Sha256OfFile(const std::string& path);
// SHA-256 of `bytes`, as lowercase hex.
absl::StatusOr<std::string> Sha256OfBytes(absl::string_view bytes);

}  // namespace tally

#endif  // TALLY_RUNTIME_IO_SAFETENSORS_H_
