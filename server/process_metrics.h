// ProcessMetrics: the process_* series every Prometheus exporter serves
// (CPU seconds, resident and virtual memory, open and maximum file
// descriptors, start time), read from Linux's /proc at each scrape.
// prometheus-cpp 1.0.1 has no process collector, so this Collectable joins
// the registry's families on /metrics (HttpEndpoint collects both).
//
//   auto process = std::make_shared<tally::ProcessMetrics>(
//       prometheus::Labels{{"rank", "0"}});
//   for (const prometheus::MetricFamily& family : process->Collect()) ...
#ifndef TALLY_SERVER_PROCESS_METRICS_H_
#define TALLY_SERVER_PROCESS_METRICS_H_

#include <prometheus/collectable.h>
#include <prometheus/labels.h>
#include <prometheus/metric_family.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tally {

// What /proc says about one process, in the units of the process_* series.
struct ProcessSample {
  double cpu_seconds = 0;  // user + system
  double resident_bytes = 0;
  double virtual_bytes = 0;
  double open_fds = 0;
  double max_fds = 0;             // the soft RLIMIT_NOFILE
  double start_time_seconds = 0;  // Unix time
};

// Reads this process's sample from /proc/self (and the boot time from
// /proc/stat). An error names the file it could not read or parse.
absl::StatusOr<ProcessSample> ReadProcessSample();

class ProcessMetrics : public prometheus::Collectable {
 public:
  // Every series carries `labels` (the rank's constant label).
  explicit ProcessMetrics(prometheus::Labels labels);

  // The six process_* families of this process, or none when /proc cannot
  // be read (a scrape never fails for them).
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const prometheus::Labels labels_;
};

}  // namespace tally

#endif  // TALLY_SERVER_PROCESS_METRICS_H_
