#include "base/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tally {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

const char* LevelTag(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "D";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarning:
      return "W";
    case LogLevel::kError:
      return "E";
  }
  return "?";
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warning") return LogLevel::kWarning;
  if (name == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(absl::StrCat(
      "log level must be debug, info, warning or error, got '", name, "'"));
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level; }

void Log(LogLevel level, absl::string_view message) {
  if (!LogEnabled(level)) return;
  // One fputs per line keeps lines from different threads whole.
  std::string line =
      absl::StrCat(LevelTag(level),
                   absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(),
                                    absl::UTCTimeZone()),
                   " ", getpid(), "] ", message, "\n");
  std::fputs(line.c_str(), stderr);
}

}  // namespace tally
