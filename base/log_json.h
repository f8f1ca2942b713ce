// JSON log lines for output tally did not format itself: the --nproc-per-node
// launcher (server/launcher.h) wraps each line its ranks write in a format of
// their own (a library's: LibTorch's glog, gRPC) so that --log-format json
// output stays one JSON object per line (base/log.h has the fields).
//
//   std::string line = tally::JsonLogLine(tally::LogLevel::kInfo,
//                                         "W1127 gloo: ...", absl::Now(), 1);
#ifndef TALLY_BASE_LOG_JSON_H_
#define TALLY_BASE_LOG_JSON_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tally {

// base/log.h's, declared here, not included: log.cc writes these lines and
// includes this header (a caller includes log.h for the levels).
enum class LogLevel;

// The JSON line (with its '\n') of `message`, written by process `rank`,
// with no model or request id.
std::string JsonLogLine(LogLevel level, absl::string_view message,
                        absl::Time time, int rank);

}  // namespace tally

#endif  // TALLY_BASE_LOG_JSON_H_
