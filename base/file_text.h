// ReadFileText: a whole file as bytes, with an error that names it — for the
// small files flags point at (PEM certificates and keys, token files).
//
//   TALLY_ASSIGN_OR_RETURN(std::string pem,
//                          tally::ReadFileText(path, "--ca-cert"));
#ifndef TALLY_BASE_FILE_TEXT_H_
#define TALLY_BASE_FILE_TEXT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

// INVALID_ARGUMENT "<what>: cannot read <path>" when the file cannot be
// opened or read.
absl::StatusOr<std::string> ReadFileText(const std::string& path,
                                         absl::string_view what);

}  // namespace tally

#endif  // TALLY_BASE_FILE_TEXT_H_
