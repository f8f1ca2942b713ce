// The one whole-file reader, with errors that name the file. ReadFileUpTo
// bounds what it reads, for files a client can point the server at (JSON
// configs through base/json_reader.h, tokenizer files a weights export
// copies) and the kernel's files (/proc, cgroup limits: kMaxSystemFileBytes);
// ReadFileText is for the small files flags point at (PEM certificates and
// keys, token files). Both keep their buffer on the heap, so they are safe on
// any thread, however small its stack (civetweb's, which runs a scrape).
//
//   TALLY_ASSIGN_OR_RETURN(std::string pem,
//                          tally::ReadFileText(path, "--ca-cert"));
//   TALLY_ASSIGN_OR_RETURN(std::string text,
//                          tally::ReadFileUpTo(path, 1 << 20));
#ifndef TALLY_BASE_FILE_TEXT_H_
#define TALLY_BASE_FILE_TEXT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

// A bound for the kernel's text files (/proc/self/stat, /proc/meminfo,
// cgroup limits): a few KB, /proc/stat ~100 KB on a machine of 1000 CPUs.
inline constexpr uint64_t kMaxSystemFileBytes = uint64_t{4} << 20;

// The whole file at `path` when it holds at most `max_bytes`. A file that
// cannot be opened or read gets its errno's status naming the path
// (NOT_FOUND when missing); a longer one `too_large`'s code, naming the
// path and the limit, after reading no more than max_bytes + 1 bytes (a file
// that grows while it is read). Anything but a regular file (a FIFO, a
// device, a directory) is refused with `too_large`'s code, without blocking.
absl::StatusOr<std::string> ReadFileUpTo(
    const std::string& path, uint64_t max_bytes,
    absl::StatusCode too_large = absl::StatusCode::kResourceExhausted);

// INVALID_ARGUMENT "<what>: cannot read <path>" when the file cannot be
// opened or read.
absl::StatusOr<std::string> ReadFileText(const std::string& path,
                                         absl::string_view what);

}  // namespace tally

#endif  // TALLY_BASE_FILE_TEXT_H_
