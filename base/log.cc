#include "base/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/enum_names.h"
#include "base/log_json.h"

namespace tally {
namespace {

constexpr int kNoRank = -1;

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};
std::atomic<int> g_rank{kNoRank};
thread_local const LogContext* t_context = nullptr;

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

constexpr EnumName<LogLevel> kLogLevelNames[] = {
    {LogLevel::kDebug, "debug"},
    {LogLevel::kInfo, "info"},
    {LogLevel::kWarning, "warning"},
    {LogLevel::kError, "error"},
};
constexpr EnumName<LogFormat> kLogFormatNames[] = {
    {LogFormat::kText, "text"},
    {LogFormat::kJson, "json"},
};

std::string UtcTime(absl::Time time) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", time, absl::UTCTimeZone());
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  if (std::optional<LogLevel> level = ValueNamed(kLogLevelNames, name)) {
    return *level;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "log level must be ", NameList(kLogLevelNames), ", got '", name, "'"));
}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (std::optional<LogFormat> format = ValueNamed(kLogFormatNames, name)) {
    return *format;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "log format must be ", NameList(kLogFormatNames), ", got '", name, "'"));
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

void SetLogFormat(LogFormat format) { g_format = static_cast<int>(format); }

void SetLogRank(int rank) { g_rank = rank; }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level; }

LogContext::LogContext(absl::string_view model, absl::string_view request_id)
    : outer_(t_context), model_(model), request_id_(request_id) {
  t_context = this;
}

LogContext::~LogContext() { t_context = outer_; }

namespace {

// The JSON line: `rank` kNoRank and an empty model or request id are null.
std::string JsonLine(LogLevel level, absl::string_view message, absl::Time time,
                     int rank, absl::string_view model,
                     absl::string_view request_id) {
  auto text_or_null = [](absl::string_view text) {
    return text.empty() ? nlohmann::ordered_json(nullptr)
                        : nlohmann::ordered_json(std::string(text));
  };
  const nlohmann::ordered_json line = {
      {"time", UtcTime(time)},
      {"level", NameOf(kLogLevelNames, level)},
      {"rank", rank == kNoRank ? nlohmann::ordered_json(nullptr)
                               : nlohmann::ordered_json(rank)},
      {"model", text_or_null(model)},
      {"request_id", text_or_null(request_id)},
      {"message", std::string(message)},
  };
  // Invalid UTF-8 (a model id, an exception's text) is replaced, never
  // thrown.
  return absl::StrCat(
      line.dump(-1, ' ', false,
                nlohmann::ordered_json::error_handler_t::replace),
      "\n");
}

}  // namespace

std::string FormatLogLine(LogLevel level, absl::string_view message,
                          absl::Time time) {
  if (static_cast<LogFormat>(g_format.load()) == LogFormat::kText) {
    return absl::StrCat(LevelTag(level), UtcTime(time), " ", getpid(), "] ",
                        message, "\n");
  }
  const LogContext* context = t_context;
  return JsonLine(level, message, time, g_rank, context ? context->model_ : "",
                  context ? context->request_id_ : "");
}

std::string JsonLogLine(LogLevel level, absl::string_view message,
                        absl::Time time, int rank) {
  return JsonLine(level, message, time, rank, "", "");
}

void Log(LogLevel level, absl::string_view message) {
  if (!LogEnabled(level)) return;
  // One fputs per line keeps lines from different threads whole.
  const std::string line = FormatLogLine(level, message, absl::Now());
  std::fputs(line.c_str(), stderr);
}

}  // namespace tally
