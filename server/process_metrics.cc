#include "server/process_metrics.h"

#include <dirent.h>
#include <unistd.h>

#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/file_text.h"
#include "base/status.h"

namespace tally {
namespace {

constexpr char kSelf[] = "/proc/self";

// A scrape runs this on one of the HTTP server's threads, whose stacks are
// small: ReadFileUpTo keeps its buffer on the heap.
absl::StatusOr<std::string> ReadProcFile(const std::string& path) {
  return ReadFileUpTo(path, kMaxSystemFileBytes);
}

absl::Status Unparsable(const std::string& path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("cannot parse ", what, " in ", path));
}

// The fields of /proc/<pid>/stat after the command name, which may hold
// spaces and parentheses: fields[0] is field 3 (state) of proc(5).
absl::StatusOr<std::vector<std::string>> StatFields(const std::string& path) {
  TALLY_ASSIGN_OR_RETURN(const std::string text, ReadProcFile(path));
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return Unparsable(path, "the command");
  return absl::StrSplit(
      absl::StripAsciiWhitespace(absl::string_view(text).substr(close + 1)),
      ' ', absl::SkipEmpty());
}

// proc(5)'s field `number` (1-based) of `fields` (StatFields).
absl::StatusOr<double> StatField(const std::vector<std::string>& fields,
                                 int number, const std::string& path) {
  double value = 0;
  const size_t index = static_cast<size_t>(number - 3);
  if (index >= fields.size() || !absl::SimpleAtod(fields[index], &value)) {
    return Unparsable(path, absl::StrCat("field ", number));
  }
  return value;
}

// /proc/stat's btime: the boot time in Unix seconds.
absl::StatusOr<double> BootTime() {
  const std::string path = "/proc/stat";
  TALLY_ASSIGN_OR_RETURN(const std::string text, ReadProcFile(path));
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    double value = 0;
    if (absl::ConsumePrefix(&line, "btime ") &&
        absl::SimpleAtod(absl::StripAsciiWhitespace(line), &value)) {
      return value;
    }
  }
  return Unparsable(path, "btime");
}

// The soft limit of "Max open files" in /proc/self/limits (+Inf when
// unlimited).
absl::StatusOr<double> MaxOpenFiles() {
  const std::string path = absl::StrCat(kSelf, "/limits");
  TALLY_ASSIGN_OR_RETURN(const std::string text, ReadProcFile(path));
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, "Max open files")) continue;
    const std::vector<absl::string_view> words =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    double value = 0;
    if (!words.empty() && words[0] == "unlimited") {
      return std::numeric_limits<double>::infinity();
    }
    if (!words.empty() && absl::SimpleAtod(words[0], &value)) return value;
  }
  return Unparsable(path, "Max open files");
}

// Open descriptors, less the one the listing itself holds.
absl::StatusOr<double> OpenFds() {
  const std::string path = absl::StrCat(kSelf, "/fd");
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) {
    return absl::NotFoundError(absl::StrCat("cannot list ", path));
  }
  double count = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - 1;
}

prometheus::MetricFamily Family(const char* name, const char* help,
                                prometheus::MetricType type, double value,
                                const prometheus::Labels& labels) {
  prometheus::ClientMetric metric;
  for (const auto& [key, label_value] : labels) {
    metric.label.push_back({key, label_value});
  }
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return prometheus::MetricFamily{name, help, type, {std::move(metric)}};
}

}  // namespace

absl::StatusOr<ProcessSample> ReadProcessSample() {
  const std::string stat_path = absl::StrCat(kSelf, "/stat");
  TALLY_ASSIGN_OR_RETURN(const std::vector<std::string> fields,
                         StatFields(stat_path));
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  ProcessSample s;
  TALLY_ASSIGN_OR_RETURN(const double utime, StatField(fields, 14, stat_path));
  TALLY_ASSIGN_OR_RETURN(const double stime, StatField(fields, 15, stat_path));
  TALLY_ASSIGN_OR_RETURN(const double start, StatField(fields, 22, stat_path));
  TALLY_ASSIGN_OR_RETURN(s.virtual_bytes, StatField(fields, 23, stat_path));
  TALLY_ASSIGN_OR_RETURN(const double rss_pages,
                         StatField(fields, 24, stat_path));
  TALLY_ASSIGN_OR_RETURN(const double boot, BootTime());
  TALLY_ASSIGN_OR_RETURN(s.open_fds, OpenFds());
  TALLY_ASSIGN_OR_RETURN(s.max_fds, MaxOpenFiles());
  s.cpu_seconds = (utime + stime) / ticks;
  s.resident_bytes = rss_pages * page;
  s.start_time_seconds = boot + start / ticks;
  return s;
}

ProcessMetrics::ProcessMetrics(prometheus::Labels labels)
    : labels_(std::move(labels)) {}

std::vector<prometheus::MetricFamily> ProcessMetrics::Collect() const {
  const absl::StatusOr<ProcessSample> s = ReadProcessSample();
  if (!s.ok()) return {};
  using prometheus::MetricType;
  return {
      Family("process_cpu_seconds_total",
             "Total user and system CPU time spent in seconds",
             MetricType::Counter, s->cpu_seconds, labels_),
      Family("process_resident_memory_bytes", "Resident memory size in bytes",
             MetricType::Gauge, s->resident_bytes, labels_),
      Family("process_virtual_memory_bytes", "Virtual memory size in bytes",
             MetricType::Gauge, s->virtual_bytes, labels_),
      Family("process_open_fds", "Number of open file descriptors",
             MetricType::Gauge, s->open_fds, labels_),
      Family("process_max_fds", "Maximum number of open file descriptors",
             MetricType::Gauge, s->max_fds, labels_),
      Family("process_start_time_seconds",
             "Start time of the process since the Unix epoch in seconds",
             MetricType::Gauge, s->start_time_seconds, labels_),
  };
}

}  // namespace tally
