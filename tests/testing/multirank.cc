#include "tests/testing/multirank.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace tally::testing {
namespace {

constexpr char kRankVar[] = "TALLY_TEST_RANK";
constexpr char kWorldSizeVar[] = "TALLY_TEST_WORLD_SIZE";
constexpr char kCallVar[] = "TALLY_TEST_CALL";
constexpr absl::Duration kGraceAfterFailure = absl::Seconds(10);
constexpr size_t kMaxReportedOutput = 16 * 1024;

// Variables a child must not inherit: launcher identities would confuse the
// rank, and gtest sharding or XML output would apply to the child's run too.
constexpr const char* kDroppedVars[] = {kRankVar,
                                        kWorldSizeVar,
                                        kCallVar,
                                        "RANK",
                                        "WORLD_SIZE",
                                        "LOCAL_RANK",
                                        "MASTER_ADDR",
                                        "MASTER_PORT",
                                        "LWS_LEADER_ADDRESS",
                                        "LWS_GROUP_SIZE",
                                        "LWS_WORKER_INDEX",
                                        "GTEST_OUTPUT",
                                        "GTEST_FILTER",
                                        "GTEST_SHARD_INDEX",
                                        "GTEST_TOTAL_SHARDS",
                                        "GTEST_SHARD_STATUS_FILE",
                                        "XML_OUTPUT_FILE"};

// Counts RunOnRanks calls within the current test, so a child runs the
// same call its launcher made.
class CallCounter : public ::testing::EmptyTestEventListener {
 public:
  void OnTestStart(const ::testing::TestInfo&) override { calls_ = 0; }
  int Next() { return calls_++; }

 private:
  int calls_ = 0;
};

CallCounter& Calls() {
  static CallCounter* counter = [] {
    auto* created = new CallCounter;  // owned by gtest's listener list
    ::testing::UnitTest::GetInstance()->listeners().Append(created);
    return created;
  }();
  return *counter;
}

std::string CurrentTestName() {
  const ::testing::TestInfo* info =
      ::testing::UnitTest::GetInstance()->current_test_info();
  return absl::StrCat(info->test_suite_name(), ".", info->name());
}

std::string Describe(int wait_status) {
  if (WIFEXITED(wait_status)) {
    return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
  }
  if (WIFSIGNALED(wait_status)) {
    return absl::StrCat("killed by signal ", WTERMSIG(wait_status), " (",
                        strsignal(WTERMSIG(wait_status)), ")");
  }
  return absl::StrCat("ended with wait status ", wait_status);
}

bool Succeeded(int wait_status) {
  return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
}

std::string ReadTail(int fd) {
  std::string output;
  char buffer[4096];
  off_t offset = 0;
  for (ssize_t n; (n = pread(fd, buffer, sizeof(buffer), offset)) > 0;
       offset += n) {
    output.append(buffer, static_cast<size_t>(n));
  }
  if (output.size() > kMaxReportedOutput) {
    output = absl::StrCat("[...]",
                          output.substr(output.size() - kMaxReportedOutput));
  }
  return output;
}

// Pointers into `strings` with the terminating null execve wants.
std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

std::string ThisExecutable() {
  char path[4096];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  return length > 0 ? std::string(path, static_cast<size_t>(length))
                    : "/proc/self/exe";
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int output_fd = -1;  // an unlinked temporary file: stdout and stderr
  std::optional<int> wait_status;
  std::string killed_because;
};

void Launch(int world_size, int call, absl::Duration timeout) {
  const int port = PickFreePort();
  ASSERT_GT(port, 0) << "no free port for the rendezvous";
  std::vector<std::string> base_env;
  for (char** var = environ; *var != nullptr; ++var) {
    bool dropped = false;
    for (const char* name : kDroppedVars) {
      dropped |= absl::StartsWith(*var, absl::StrCat(name, "="));
    }
    if (!dropped) base_env.push_back(*var);
  }
  std::vector<std::string> argv = {
      ThisExecutable(), absl::StrCat("--gtest_filter=", CurrentTestName()),
      "--gtest_also_run_disabled_tests"};

  std::vector<Child> children(world_size);
  const pid_t launcher = getpid();
  for (int rank = 0; rank < world_size; ++rank) {
    Child& child = children[rank];
    child.rank = rank;
    std::string path = ::testing::TempDir() + "tally_rank_XXXXXX";
    child.output_fd = mkstemp(path.data());
    ASSERT_GE(child.output_fd, 0)
        << "mkstemp " << path << ": " << std::strerror(errno);
    unlink(path.c_str());
    std::vector<std::string> env = base_env;
    env.push_back(absl::StrCat(kRankVar, "=", rank));
    env.push_back(absl::StrCat(kWorldSizeVar, "=", world_size));
    env.push_back(absl::StrCat(kCallVar, "=", call));
    env.push_back(absl::StrCat("MASTER_PORT=", port));
    // Built before fork: the child may only make async-signal-safe calls.
    std::vector<char*> child_argv = CStrings(argv);
    std::vector<char*> child_env = CStrings(env);
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(127);  // the launcher already died
      dup2(child.output_fd, STDOUT_FILENO);
      dup2(child.output_fd, STDERR_FILENO);
      execve(child_argv[0], child_argv.data(), child_env.data());
      _exit(127);
    }
    ASSERT_GT(pid, 0) << "fork: " << std::strerror(errno);
    child.pid = pid;
  }

  const absl::Time deadline = absl::Now() + timeout;
  std::optional<absl::Time> first_failure;
  for (int running = world_size; running > 0;) {
    for (Child& child : children) {
      int wait_status = 0;
      if (child.wait_status ||
          waitpid(child.pid, &wait_status, WNOHANG) != child.pid) {
        continue;
      }
      child.wait_status = wait_status;
      --running;
      if (!Succeeded(wait_status) && !first_failure) {
        first_failure = absl::Now();
      }
    }
    if (running == 0) break;
    const absl::Time now = absl::Now();
    std::string kill_reason;
    if (now >= deadline) {
      kill_reason = absl::StrCat("killed: not done within ",
                                 absl::FormatDuration(timeout));
    } else if (first_failure && now >= *first_failure + kGraceAfterFailure) {
      kill_reason = "killed: still running after another rank failed";
    }
    if (!kill_reason.empty()) {
      for (Child& child : children) {
        if (child.wait_status) continue;
        kill(child.pid, SIGKILL);
        int wait_status = 0;
        waitpid(child.pid, &wait_status, 0);
        child.wait_status = wait_status;
        child.killed_because = kill_reason;
      }
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }

  for (Child& child : children) {
    if (!Succeeded(*child.wait_status)) {
      ADD_FAILURE() << "rank " << child.rank << " of " << world_size << " "
                    << (child.killed_because.empty()
                            ? Describe(*child.wait_status)
                            : child.killed_because)
                    << "\n----- rank " << child.rank << " output -----\n"
                    << ReadTail(child.output_fd) << "----- end of rank "
                    << child.rank << " -----";
    }
    close(child.output_fd);
  }
}

std::string GetEnv(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

[[noreturn]] void RunAsRank(int world_size, const RankBody& body) {
  // The launcher's variables in torchrun's names, so the child resolves its
  // identity the way a production rank does.
  const std::map<std::string, std::string> vars = {
      {"RANK", GetEnv(kRankVar)},
      {"WORLD_SIZE", GetEnv(kWorldSizeVar)},
      {"LOCAL_RANK", GetEnv(kRankVar)},
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", GetEnv("MASTER_PORT")}};
  absl::StatusOr<RankEnv> env =
      ResolveRankEnv({}, [&](const char* name) -> std::optional<std::string> {
        auto it = vars.find(name);
        if (it == vars.end()) return std::nullopt;
        return it->second;
      });
  absl::Status status = env.status();
  if (status.ok() && env->world_size != world_size) {
    status = absl::InvalidArgumentError(
        absl::StrCat(kWorldSizeVar, "=", env->world_size,
                     " but RunOnRanks was called for ", world_size, " ranks"));
  }
  if (status.ok()) {
    try {
      status = body(*env);
    } catch (const std::exception& e) {
      status =
          absl::InternalError(absl::StrCat("uncaught exception: ", e.what()));
    }
  }
  if (!status.ok()) {
    std::cerr << "rank " << vars.at("RANK") << " failed: " << status << "\n";
  }
  const bool failed = !status.ok() || ::testing::Test::HasFailure();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // Skips gtest's and LibTorch's teardown: this process's work is done.
  std::_Exit(failed ? 1 : 0);
}

}  // namespace

int PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

void RunOnRanks(int world_size, const RankBody& body, absl::Duration timeout) {
  const int call = Calls().Next();
  if (std::getenv(kRankVar) == nullptr) {
    Launch(world_size, call, timeout);
    return;
  }
  // A child runs only the call its launcher made; earlier calls of the same
  // test belong to other children.
  const char* target_call = std::getenv(kCallVar);
  if (target_call == nullptr || absl::StrCat(call) != target_call) return;
  RunAsRank(world_size, body);
}

MeshShape Shape(int dp_replicate, int dp_shard, int tp, int cp, int ep,
                int pp) {
  MeshShape shape;
  shape.dp_replicate = dp_replicate;
  shape.dp_shard = dp_shard;
  shape.tp = tp;
  shape.cp = cp;
  shape.ep = ep;
  shape.pp = pp;
  return shape;
}

}  // namespace tally::testing
