// Minimal leveled logging to stderr, shared by every tally library.
//
//   tally::SetLogLevel(tally::LogLevel::kDebug);
//   tally::Log(tally::LogLevel::kInfo, absl::StrCat("listening on ", port));
#ifndef TALLY_BASE_LOG_H_
#define TALLY_BASE_LOG_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

enum class LogLevel { kDebug = 0, kInfo, kWarning, kError };

// "debug", "info", "warning" or "error".
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);
// One line, prefixed with a UTC timestamp, the level and the pid; thread-safe.
void Log(LogLevel level, absl::string_view message);

}  // namespace tally

#endif  // TALLY_BASE_LOG_H_
