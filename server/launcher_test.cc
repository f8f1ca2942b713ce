// The local rank launcher: environment, failure propagation, signal
// forwarding, the SIGKILL escalation and the "[rank r] " output prefix (or
// JSON lines), with /bin/sh ranks. Tests where the launcher itself receives
// signals run it in a forked child: in this multi-threaded test binary, other
// threads do not block SIGTERM, so the signal could land on one of them.
#include "server/launcher.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tally {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream file(path);
  std::stringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

bool Contains(const std::vector<std::string>& lines, const std::string& line) {
  return std::find(lines.begin(), lines.end(), line) != lines.end();
}

// Waits until every path exists; false after `timeout`.
bool WaitForFiles(const std::vector<std::string>& paths,
                  absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (std::all_of(paths.begin(), paths.end(), [](const std::string& path) {
          return std::filesystem::exists(path);
        })) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / "tally-launcher-XXXXXX")
               .string();
    ASSERT_NE(mkdtemp(dir_.data()), nullptr) << std::strerror(errno);
  }
  void TearDown() override {
    // A failed assertion must not leave a launcher (and its ranks) behind.
    for (const pid_t launcher : unreaped_launchers_) {
      kill(launcher, SIGKILL);
      waitpid(launcher, nullptr, 0);
    }
    std::filesystem::remove_all(dir_);
  }

  // Ranks run `/bin/sh -c script`, where $0 is this test's scratch directory.
  LaunchOptions ShellRanks(int nproc, const std::string& script) const {
    LaunchOptions options;
    options.nproc = nproc;
    options.executable = "/bin/sh";
    options.args = {"sh", "-c", script, dir_};
    return options;
  }

  std::string Path(const std::string& name) const {
    return absl::StrCat(dir_, "/", name);
  }

  std::vector<std::string> RankFiles(const std::string& stem, int nproc) const {
    std::vector<std::string> paths;
    for (int rank = 0; rank < nproc; ++rank) {
      paths.push_back(Path(absl::StrCat(stem, ".", rank)));
    }
    return paths;
  }

  // Runs LaunchAndSupervise in a forked child, as main() would: SIGINT and
  // SIGTERM blocked first. The child writes the status to "result" and exits
  // 0 iff it is OK. Optional files receive the launcher's stdout / stderr.
  pid_t ForkLauncher(const LaunchOptions& options,
                     const std::string& stdout_path = "",
                     const std::string& stderr_path = "") {
    const std::string result_path = Path("result");
    const pid_t pid = fork();
    if (pid != 0) {
      unreaped_launchers_.push_back(pid);
      return pid;
    }
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    const std::pair<std::string, int> redirects[] = {
        {stdout_path, STDOUT_FILENO}, {stderr_path, STDERR_FILENO}};
    for (const auto& [path, target_fd] : redirects) {
      if (path.empty()) continue;
      const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd < 0 || dup2(fd, target_fd) < 0) _exit(3);
      close(fd);
    }
    const absl::Status status = LaunchAndSupervise(options);
    std::ofstream(result_path) << status.ToString();
    _exit(status.ok() ? 0 : 1);
  }

  // The launcher child's exit code, or -1 (after SIGKILL) past `timeout`.
  int WaitForExit(pid_t pid, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    int wait_status = 0;
    while (waitpid(pid, &wait_status, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &wait_status, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    unreaped_launchers_.erase(std::remove(unreaped_launchers_.begin(),
                                          unreaped_launchers_.end(), pid),
                              unreaped_launchers_.end());
    return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : -1;
  }

  std::string dir_;
  std::vector<pid_t> unreaped_launchers_;
};

TEST_F(LauncherTest, EveryRankGetsItsEnvironment) {
  // Inherited values of the launcher's variables are replaced; others kept.
  ASSERT_EQ(setenv("RANK", "99", 1), 0);
  ASSERT_EQ(setenv("TALLY_LAUNCHER_TEST_MARKER", "inherited", 1), 0);
  const std::string script =
      "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR "
      "$MASTER_PORT $TALLY_LAUNCHER_TEST_MARKER > \"$0/env.$RANK\"";
  for (const int requested_port : {0, 29517}) {
    SCOPED_TRACE(absl::StrCat("master_port ", requested_port));
    constexpr int kRanks = 3;
    LaunchOptions options = ShellRanks(kRanks, script);
    options.master_port = requested_port;
    ASSERT_TRUE(LaunchAndSupervise(options).ok());

    const std::vector<std::string> rank0 =
        absl::StrSplit(ReadFile(Path("env.0")), ' ');
    ASSERT_EQ(rank0.size(), 7u) << ReadFile(Path("env.0"));
    int port = 0;
    ASSERT_TRUE(absl::SimpleAtoi(rank0[5], &port)) << rank0[5];
    if (requested_port == 0) {
      EXPECT_GT(port, 0);
      EXPECT_LE(port, 65535);
    } else {
      EXPECT_EQ(port, requested_port);
    }
    for (int rank = 0; rank < kRanks; ++rank) {
      EXPECT_EQ(ReadFile(Path(absl::StrCat("env.", rank))),
                absl::StrCat(rank, " ", rank, " ", kRanks, " ", kRanks,
                             " 127.0.0.1 ", port, " inherited\n"))
          << "rank " << rank;
    }
  }
  unsetenv("RANK");
  unsetenv("TALLY_LAUNCHER_TEST_MARKER");
}

TEST_F(LauncherTest, FailingRankStopsTheOthersWithSigterm) {
  const absl::Time start = absl::Now();
  absl::Status status = LaunchAndSupervise(
      ShellRanks(4, "if [ \"$RANK\" = 2 ]; then exit 3; fi; exec sleep 60"));
  // Far below the 10 s stop_grace: the sleeping ranks ended on SIGTERM.
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status.message(), "rank 2 exited with status 3");
}

TEST_F(LauncherTest, RankKilledBySignalIsNamed) {
  absl::Status status = LaunchAndSupervise(ShellRanks(
      2, "if [ \"$RANK\" = 1 ]; then kill -KILL $$; fi; exec sleep 60"));
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status.message(), absl::StrCat("rank 1 killed by signal ", SIGKILL,
                                           " (", strsignal(SIGKILL), ")"));
}

TEST_F(LauncherTest, RankIgnoringSigtermIsKilledAfterTheGrace) {
  // Rank 0 fails only once rank 1 ignores SIGTERM (SIG_IGN survives exec).
  LaunchOptions options =
      ShellRanks(2,
                 "if [ \"$RANK\" = 1 ]; then trap '' TERM; touch \"$0/ready\"; "
                 "exec sleep 60; fi; "
                 "i=0; while [ ! -e \"$0/ready\" ] && [ $i -lt 500 ]; do "
                 "sleep 0.01; i=$((i + 1)); done; exit 1");
  options.stop_grace = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  absl::Status status = LaunchAndSupervise(options);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(status.message(), "rank 0 exited with status 1");
  EXPECT_GE(elapsed, options.stop_grace);
  EXPECT_LT(elapsed, absl::Seconds(5));
}

TEST_F(LauncherTest, ForwardedSignalAndCleanExitIsOk) {
  constexpr int kRanks = 3;
  for (const int signal_number : {SIGTERM, SIGINT}) {
    SCOPED_TRACE(strsignal(signal_number));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directory(dir_);
    // The trap records which signal reached the rank, stops its sleep and
    // exits 0, as tally-server does on SIGTERM/SIGINT.
    const pid_t launcher = ForkLauncher(ShellRanks(
        kRanks,
        "trap 'kill $! 2>/dev/null; echo TERM > \"$0/got.$RANK\"; exit 0' "
        "TERM; "
        "trap 'kill $! 2>/dev/null; echo INT > \"$0/got.$RANK\"; exit 0' INT; "
        "touch \"$0/ready.$RANK\"; sleep 60 & wait"));
    ASSERT_TRUE(WaitForFiles(RankFiles("ready", kRanks), absl::Seconds(10)));
    const absl::Time signalled = absl::Now();
    ASSERT_EQ(kill(launcher, signal_number), 0);
    // Far below the 10 s stop_grace: no rank needed SIGKILL.
    EXPECT_EQ(WaitForExit(launcher, absl::Seconds(5)), 0)
        << ReadFile(Path("result"));
    EXPECT_LT(absl::Now() - signalled, absl::Seconds(5));
    EXPECT_EQ(ReadFile(Path("result")), "OK");
    const std::string expected_trap = signal_number == SIGTERM ? "TERM" : "INT";
    for (const std::string& got : RankFiles("got", kRanks)) {
      EXPECT_EQ(ReadFile(got), expected_trap + "\n") << got;
    }
  }
}

TEST_F(LauncherTest, ForwardedSigtermIgnoredEndsInSigkill) {
  constexpr int kRanks = 2;
  LaunchOptions options = ShellRanks(
      kRanks, "trap '' TERM; touch \"$0/ready.$RANK\"; exec sleep 60");
  options.stop_grace = absl::Milliseconds(500);
  const pid_t launcher = ForkLauncher(options);
  ASSERT_TRUE(WaitForFiles(RankFiles("ready", kRanks), absl::Seconds(10)));
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(kill(launcher, SIGTERM), 0);
  EXPECT_EQ(WaitForExit(launcher, absl::Seconds(5)), 1);
  const absl::Duration elapsed = absl::Now() - signalled;
  EXPECT_GE(elapsed, options.stop_grace);
  EXPECT_LT(elapsed, absl::Seconds(5));
  // Both ranks die of the same SIGKILL: either may be reaped first.
  const std::string result = ReadFile(Path("result"));
  const auto killed_after_grace = [&](int rank) {
    return absl::StrCat("INTERNAL: rank ", rank, " killed by signal ", SIGKILL,
                        " (", strsignal(SIGKILL),
                        ") after not stopping within ",
                        absl::FormatDuration(options.stop_grace));
  };
  EXPECT_TRUE(result == killed_after_grace(0) ||
              result == killed_after_grace(1))
      << result;
}

// Dead, or a zombie nobody reaps (PID 1 of a container may not).
bool ProcessIsGone(pid_t pid) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t after_name = stat.rfind(") ");
  return stat.empty() ||
         (after_name != std::string::npos && stat[after_name + 2] == 'Z');
}

TEST_F(LauncherTest, RanksDieWithTheLauncher) {
  constexpr int kRanks = 2;
  const pid_t launcher =
      ForkLauncher(ShellRanks(kRanks,
                              "echo $$ > \"$0/pid.$RANK.tmp\"; "
                              "mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; "
                              "exec sleep 60"));
  ASSERT_TRUE(WaitForFiles(RankFiles("pid", kRanks), absl::Seconds(10)));
  std::vector<pid_t> rank_pids;
  for (const std::string& path : RankFiles("pid", kRanks)) {
    int pid = 0;
    ASSERT_TRUE(absl::SimpleAtoi(Lines(ReadFile(path)).at(0), &pid)) << path;
    ASSERT_FALSE(ProcessIsGone(pid)) << "rank pid " << pid;
    rank_pids.push_back(pid);
  }
  ASSERT_EQ(kill(launcher, SIGKILL), 0);
  EXPECT_EQ(WaitForExit(launcher, absl::Seconds(5)), -1);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  for (const pid_t pid : rank_pids) {
    while (!ProcessIsGone(pid) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_TRUE(ProcessIsGone(pid)) << "rank pid " << pid;
  }
}

TEST_F(LauncherTest, OutputLinesArePrefixedWithTheRank) {
  constexpr int kRanks = 2;
  const pid_t launcher = ForkLauncher(
      ShellRanks(kRanks,
                 "echo out $RANK; echo err $RANK >&2; echo more $RANK; "
                 "printf 'unterminated %s' $RANK"),
      Path("stdout"), Path("stderr"));
  ASSERT_EQ(WaitForExit(launcher, absl::Seconds(10)), 0)
      << ReadFile(Path("result"));
  const std::vector<std::string> out = Lines(ReadFile(Path("stdout")));
  const std::vector<std::string> err = Lines(ReadFile(Path("stderr")));
  EXPECT_EQ(out.size(), 3u * kRanks) << ReadFile(Path("stdout"));
  for (int rank = 0; rank < kRanks; ++rank) {
    const std::string prefix = absl::StrCat("[rank ", rank, "] ");
    for (const char* word : {"out", "more", "unterminated"}) {
      EXPECT_TRUE(Contains(out, absl::StrCat(prefix, word, " ", rank)))
          << word << " of rank " << rank;
    }
    EXPECT_TRUE(Contains(err, absl::StrCat(prefix, "err ", rank)))
        << ReadFile(Path("stderr"));
  }
  // Within a rank, lines keep their order.
  for (int rank = 0; rank < kRanks; ++rank) {
    const std::string prefix = absl::StrCat("[rank ", rank, "] ");
    const auto out_line =
        std::find(out.begin(), out.end(), absl::StrCat(prefix, "out ", rank));
    const auto more_line =
        std::find(out.begin(), out.end(), absl::StrCat(prefix, "more ", rank));
    EXPECT_LT(out_line, more_line) << "rank " << rank;
  }
}

// --log-format json: JSON lines pass unchanged; any other line (a library's
// own format) becomes a JSON object of its rank; no prefix.
TEST_F(LauncherTest, JsonOutputWrapsForeignLines) {
  constexpr int kRanks = 2;
  LaunchOptions options =
      ShellRanks(kRanks, "echo '{\"rank\":'$RANK'}'; echo plain $RANK");
  options.json_output = true;
  const pid_t launcher = ForkLauncher(options, Path("stdout"));
  ASSERT_EQ(WaitForExit(launcher, absl::Seconds(10)), 0)
      << ReadFile(Path("result"));
  const std::vector<std::string> out = Lines(ReadFile(Path("stdout")));
  ASSERT_EQ(out.size(), 2u * kRanks) << ReadFile(Path("stdout"));
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_TRUE(Contains(out, absl::StrCat("{\"rank\":", rank, "}")));
    const auto wrapped = std::find_if(out.begin(), out.end(), [&](auto& line) {
      return absl::StrContains(line, absl::StrCat("plain ", rank));
    });
    ASSERT_NE(wrapped, out.end()) << rank;
    const nlohmann::json line = nlohmann::json::parse(*wrapped);
    EXPECT_EQ(line["rank"], rank);
    EXPECT_EQ(line["level"], "info");
    EXPECT_EQ(line["message"], absl::StrCat("plain ", rank));
  }
}

TEST_F(LauncherTest, DefaultExecutableIsThisBinary) {
  // The ranks list this very test, which only this binary knows.
  const ::testing::TestInfo* self =
      ::testing::UnitTest::GetInstance()->current_test_info();
  constexpr int kRanks = 2;
  LaunchOptions options;
  options.nproc = kRanks;
  options.args = {"tally_unit_tests", "--gtest_list_tests",
                  absl::StrCat("--gtest_filter=", self->test_suite_name(), ".",
                               self->name())};
  const pid_t launcher = ForkLauncher(options, Path("stdout"));
  ASSERT_EQ(WaitForExit(launcher, absl::Seconds(60)), 0)
      << ReadFile(Path("result"));
  const std::vector<std::string> out = Lines(ReadFile(Path("stdout")));
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_TRUE(
        Contains(out, absl::StrCat("[rank ", rank, "]   ", self->name())))
        << ReadFile(Path("stdout"));
  }
}

TEST_F(LauncherTest, BadOptionsAreNamed) {
  struct Case {
    LaunchOptions options;
    const char* named;
  };
  std::vector<Case> cases(6, {ShellRanks(1, "exit 0"), ""});
  cases[0].options.nproc = 0;
  cases[0].named = "nproc";
  cases[1].options.executable = Path("no-such-program");
  cases[1].named = "executable";
  cases[2].options.master_port = 70000;
  cases[2].named = "master_port";
  cases[3].options.master_addr = "";
  cases[3].named = "master_addr";
  cases[4].options.stop_grace = absl::Seconds(-1);
  cases[4].named = "stop_grace";
  cases[5].options.args.clear();
  cases[5].named = "args";
  for (const Case& c : cases) {
    const absl::Status status = LaunchAndSupervise(c.options);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.named;
    EXPECT_NE(status.message().find(c.named), std::string::npos) << status;
  }
}

TEST(LauncherPortTest, PickedPortCanBeBound) {
  absl::StatusOr<int> port = PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok()) << port.status();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(*port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0)
      << std::strerror(errno);
  close(fd);
}

TEST(LauncherPortTest, UnbindableMasterAddrIsNamed) {
  // 192.0.2.1 (TEST-NET-1) is never a local address.
  absl::StatusOr<int> port = PickFreePort("192.0.2.1");
  EXPECT_EQ(port.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(port.status().message().find("master_addr"), std::string::npos)
      << port.status();
}

TEST(LauncherArgsTest, OnlyTheLauncherFlagIsDropped) {
  const char* argv[] = {"tally-server",       "--tp",        "2",
                        "--nproc-per-node",   "4",           "--dp-shard=2",
                        "--nproc-per-node=4", "--log-level", "debug"};
  EXPECT_EQ(ArgsForRanks(9, argv),
            (std::vector<std::string>{"tally-server", "--tp", "2",
                                      "--dp-shard=2", "--log-level", "debug"}));
}

}  // namespace
}  // namespace tally
