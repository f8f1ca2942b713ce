// ProcessMetrics against what the test process itself measures: its CPU time
// (getrusage), resident and virtual size (/proc/self/statm), the descriptors
// it opens and its limit (getrlimit), and a start time between boot and now.
#include "server/process_metrics.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tally {
namespace {

double Seconds(const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; }

// /proc/self/statm: sizes in pages (total, resident, ...).
std::vector<double> StatmBytes() {
  std::ifstream statm("/proc/self/statm");
  double total = 0, resident = 0;
  statm >> total >> resident;
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  return {total * page, resident * page};
}

TEST(ProcessMetricsTest, SampleMatchesTheProcess) {
  // Some CPU time to measure.
  volatile double sink = 0;
  for (int i = 0; i < 20'000'000; ++i) sink = sink + i * 0.5;
  rusage before{};
  ASSERT_EQ(getrusage(RUSAGE_SELF, &before), 0);
  const absl::StatusOr<ProcessSample> sample = ReadProcessSample();
  ASSERT_TRUE(sample.ok()) << sample.status();
  rusage after{};
  ASSERT_EQ(getrusage(RUSAGE_SELF, &after), 0);
  // /proc counts in clock ticks (1/100 s): within two ticks of getrusage.
  const double tick = 1.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
  EXPECT_GE(sample->cpu_seconds,
            Seconds(before.ru_utime) + Seconds(before.ru_stime) - 2 * tick);
  EXPECT_LE(sample->cpu_seconds,
            Seconds(after.ru_utime) + Seconds(after.ru_stime) + 2 * tick);
  EXPECT_GT(sample->cpu_seconds, 0);

  const std::vector<double> statm = StatmBytes();
  EXPECT_NEAR(sample->virtual_bytes, statm[0], 0.05 * statm[0]);
  EXPECT_NEAR(sample->resident_bytes, statm[1], 0.05 * statm[1]);

  rlimit files{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &files), 0);
  EXPECT_EQ(sample->max_fds, static_cast<double>(files.rlim_cur));

  const double now = absl::ToUnixSeconds(absl::Now());
  EXPECT_LE(sample->start_time_seconds, now + 1);
  // The process is younger than the machine's uptime and started at most a
  // tick before it first measured itself.
  std::ifstream uptime_file("/proc/uptime");
  double uptime = 0;
  uptime_file >> uptime;
  EXPECT_GE(sample->start_time_seconds, now - uptime - 1);
}

TEST(ProcessMetricsTest, OpenFdsCountsDescriptors) {
  const absl::StatusOr<ProcessSample> before = ReadProcessSample();
  ASSERT_TRUE(before.ok()) << before.status();
  const int a = open("/dev/null", O_RDONLY);
  const int b = open("/dev/null", O_RDONLY);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  const absl::StatusOr<ProcessSample> opened = ReadProcessSample();
  close(a);
  close(b);
  const absl::StatusOr<ProcessSample> closed = ReadProcessSample();
  ASSERT_TRUE(opened.ok() && closed.ok());
  EXPECT_EQ(opened->open_fds, before->open_fds + 2);
  EXPECT_EQ(closed->open_fds, before->open_fds);
}

TEST(ProcessMetricsTest, CollectsTheSixFamiliesWithTheLabels) {
  const ProcessMetrics metrics(prometheus::Labels{{"rank", "3"}});
  std::map<std::string, prometheus::MetricType> families;
  for (const prometheus::MetricFamily& family : metrics.Collect()) {
    families[family.name] = family.type;
    ASSERT_EQ(family.metric.size(), 1u) << family.name;
    ASSERT_EQ(family.metric[0].label.size(), 1u) << family.name;
    EXPECT_EQ(family.metric[0].label[0].name, "rank");
    EXPECT_EQ(family.metric[0].label[0].value, "3");
  }
  using prometheus::MetricType;
  const std::map<std::string, MetricType> expected = {
      {"process_cpu_seconds_total", MetricType::Counter},
      {"process_resident_memory_bytes", MetricType::Gauge},
      {"process_virtual_memory_bytes", MetricType::Gauge},
      {"process_open_fds", MetricType::Gauge},
      {"process_max_fds", MetricType::Gauge},
      {"process_start_time_seconds", MetricType::Gauge}};
  EXPECT_EQ(families, expected);
}

}  // namespace
}  // namespace tally
