// Minimal leveled logging to stderr, shared by every tally library: one line
// per message, as text (the default) or as one JSON object (--log-format
// json: time, level, rank, model, request_id, message), for log pipelines
// that parse fields.
//
//   tally::SetLogLevel(tally::LogLevel::kDebug);
//   tally::SetLogFormat(tally::LogFormat::kJson);
//   tally::SetLogRank(2);
//   tally::Log(tally::LogLevel::kInfo, absl::StrCat("listening on ", port));
//   {
//     tally::LogContext request("tenant/model", "7");  // this thread's lines
//     tally::Log(tally::LogLevel::kWarning, "slow");  // carry model, request
//   }
#ifndef TALLY_BASE_LOG_H_
#define TALLY_BASE_LOG_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tally {

enum class LogLevel { kDebug = 0, kInfo, kWarning, kError };
enum class LogFormat { kText, kJson };

// "debug", "info", "warning" or "error".
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);
// "text" or "json".
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);
void SetLogLevel(LogLevel level);
void SetLogFormat(LogFormat format);
// The process's rank, which JSON lines carry (null until set).
void SetLogRank(int rank);
bool LogEnabled(LogLevel level);

// The model and request (its seq_id) the calling thread works on, which
// the lines it logs carry while the scope lives; scopes nest.
class LogContext {
 public:
  LogContext(absl::string_view model, absl::string_view request_id);
  ~LogContext();
  LogContext(const LogContext&) = delete;
  LogContext& operator=(const LogContext&) = delete;

 private:
  const LogContext* const outer_;
  const std::string model_;
  const std::string request_id_;

  friend std::string FormatLogLine(LogLevel, absl::string_view, absl::Time);
};

// The line Log writes for `message` at `time` (with its '\n'): text,
// "I<UTC time> <pid>] message", or a JSON object, as SetLogFormat says.
std::string FormatLogLine(LogLevel level, absl::string_view message,
                          absl::Time time);
// One line (FormatLogLine, now); thread-safe.
void Log(LogLevel level, absl::string_view message);

}  // namespace tally

#endif  // TALLY_BASE_LOG_H_
