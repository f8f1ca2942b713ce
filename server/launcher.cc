#include "server/launcher.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "base/log_json.h"
#include "base/status.h"

extern char** environ;

namespace tally {
namespace {

// Upper bound on how late the launcher notices a rank's exit when SIGCHLD
// goes to another thread of the process (which discards it).
constexpr absl::Duration kPollInterval = absl::Milliseconds(100);
// How long the output of exited ranks is still copied; a pipe held open by a
// rank's own child must not keep the launcher alive.
constexpr absl::Duration kOutputDrainLimit = absl::Seconds(1);
// Longer lines are cut, so a rank writing without newlines cannot grow the
// launcher's memory without bound.
constexpr size_t kMaxLineBytes = size_t{64} << 10;

sigset_t LauncherSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGCHLD);
  return signals;
}

// Blocks the signals the launcher sigtimedwaits for in this thread (and in
// the threads it starts), restoring the caller's mask at scope exit.
class ScopedSignalBlock {
 public:
  ScopedSignalBlock() {
    const sigset_t signals = LauncherSignals();
    pthread_sigmask(SIG_BLOCK, &signals, &previous_);
  }
  ~ScopedSignalBlock() { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  ScopedSignalBlock(const ScopedSignalBlock&) = delete;
  ScopedSignalBlock& operator=(const ScopedSignalBlock&) = delete;

 private:
  sigset_t previous_;
};

void WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    ssize_t written = write(fd, data.data(), data.size());
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return;  // our own stdout is gone: drop the output
    data.remove_prefix(static_cast<size_t>(written));
  }
}

// Copies every rank's stdout and stderr to the launcher's, line by line,
// from a single poll() thread: with a "[rank r] " prefix, or for JSON logs
// as they are, a line that is no JSON object (a library's own) wrapped into
// one of rank r.
class OutputTagger {
 public:
  explicit OutputTagger(bool json) : json_(json) {}
  OutputTagger(const OutputTagger&) = delete;
  OutputTagger& operator=(const OutputTagger&) = delete;
  ~OutputTagger() { Finish(); }

  // Takes ownership of `read_fd`; its lines go to `destination_fd`.
  void AddStream(int rank, int read_fd, int destination_fd) {
    streams_.push_back({rank, read_fd, destination_fd, ""});
  }

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }

  // Call once every rank has exited: what they wrote is then already in the
  // pipes, so this copies what is readable now and returns.
  void Finish() {
    finishing_ = true;
    if (thread_.joinable()) thread_.join();
    for (Stream& stream : streams_) Close(stream);
  }

 private:
  struct Stream {
    int rank;
    int fd;
    int destination;
    std::string pending;  // a line not yet ended by '\n'
  };

  void Run() {
    absl::Time drain_deadline = absl::InfiniteFuture();
    std::vector<pollfd> polled;
    std::vector<Stream*> polled_streams;
    while (true) {
      polled.clear();
      polled_streams.clear();
      for (Stream& stream : streams_) {
        if (stream.fd < 0) continue;
        polled.push_back({stream.fd, POLLIN, 0});
        polled_streams.push_back(&stream);
      }
      if (polled.empty()) return;
      const bool finishing = finishing_;
      if (finishing && drain_deadline == absl::InfiniteFuture()) {
        drain_deadline = absl::Now() + kOutputDrainLimit;
      }
      if (finishing && absl::Now() > drain_deadline) return;
      const int timeout_ms =
          finishing
              ? 0
              : static_cast<int>(absl::ToInt64Milliseconds(kPollInterval));
      const int ready = poll(polled.data(), polled.size(), timeout_ms);
      if (ready < 0 && errno != EINTR) return;
      if (ready == 0 && finishing) return;
      for (size_t i = 0; i < polled.size(); ++i) {
        if (polled[i].revents != 0 && !ReadSome(*polled_streams[i])) {
          Close(*polled_streams[i]);
        }
      }
    }
  }

  // False at end of file.
  bool ReadSome(Stream& stream) {
    char buffer[16384];
    const ssize_t n = read(stream.fd, buffer, sizeof buffer);
    if (n < 0) return errno == EINTR;
    if (n == 0) return false;
    stream.pending.append(buffer, static_cast<size_t>(n));
    size_t line_start = 0;
    for (size_t eol;
         (eol = stream.pending.find('\n', line_start)) != std::string::npos;
         line_start = eol + 1) {
      WriteAll(stream.destination,
               Tagged(stream, absl::string_view(stream.pending)
                                  .substr(line_start, eol - line_start)));
    }
    stream.pending.erase(0, line_start);
    if (stream.pending.size() >= kMaxLineBytes) EmitPartialLine(stream);
    return true;
  }

  void EmitPartialLine(Stream& stream) {
    if (stream.pending.empty()) return;
    WriteAll(stream.destination, Tagged(stream, stream.pending));
    stream.pending.clear();
  }

  // `line` (without its '\n') as the launcher writes it, with its '\n'.
  std::string Tagged(const Stream& stream, absl::string_view line) const {
    if (!json_) return absl::StrCat("[rank ", stream.rank, "] ", line, "\n");
    if (absl::StartsWith(line, "{")) return absl::StrCat(line, "\n");
    return JsonLogLine(LogLevel::kInfo, line, absl::Now(), stream.rank);
  }

  void Close(Stream& stream) {
    if (stream.fd < 0) return;
    EmitPartialLine(stream);
    close(stream.fd);
    stream.fd = -1;
  }

  const bool json_;
  std::vector<Stream> streams_;
  std::atomic<bool> finishing_{false};
  std::thread thread_;
};

// A NULL-terminated char* array over owned strings, for execve: built before
// fork because the child of a multi-threaded process may only make
// async-signal-safe calls.
class ExecStrings {
 public:
  explicit ExecStrings(std::vector<std::string> strings)
      : strings_(std::move(strings)) {
    for (std::string& s : strings_) pointers_.push_back(s.data());
    pointers_.push_back(nullptr);
  }
  char* const* get() const { return pointers_.data(); }

 private:
  std::vector<std::string> strings_;
  std::vector<char*> pointers_;
};

std::vector<std::string> RankEnvironment(int rank, int nproc,
                                         const std::string& master_addr,
                                         int master_port) {
  const std::vector<std::pair<std::string, std::string>> rank_variables = {
      {"RANK", absl::StrCat(rank)},
      {"LOCAL_RANK", absl::StrCat(rank)},
      {"WORLD_SIZE", absl::StrCat(nproc)},
      {"LOCAL_WORLD_SIZE", absl::StrCat(nproc)},
      {"MASTER_ADDR", master_addr},
      {"MASTER_PORT", absl::StrCat(master_port)},
  };
  std::vector<std::string> environment;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const absl::string_view variable(*entry);
    const absl::string_view name = variable.substr(0, variable.find('='));
    const bool replaced = std::any_of(
        rank_variables.begin(), rank_variables.end(),
        [&](const auto& rank_variable) { return rank_variable.first == name; });
    if (!replaced) environment.emplace_back(variable);
  }
  for (const auto& [name, value] : rank_variables) {
    environment.push_back(absl::StrCat(name, "=", value));
  }
  return environment;
}

// Runs in the forked child: async-signal-safe calls only.
[[noreturn]] void ExecRank(const char* path, char* const* argv,
                           char* const* envp, int stdout_fd, int stderr_fd,
                           pid_t launcher_pid, absl::string_view exec_failure) {
  // The getppid check closes the race where the launcher died before prctl.
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != launcher_pid) {
    _exit(127);
  }
  if (dup2(stdout_fd, STDOUT_FILENO) < 0 ||
      dup2(stderr_fd, STDERR_FILENO) < 0) {
    _exit(127);
  }
  // A launcher started in the background by a non-interactive shell ignores
  // SIGINT, and ignored signals stay ignored across exec: the forwarded
  // signals must reach the rank.
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  execve(path, argv, envp);
  WriteAll(STDERR_FILENO, exec_failure);
  _exit(127);
}

std::string DescribeExit(int rank, int wait_status, bool killed_by_launcher,
                         absl::Duration stop_grace) {
  if (WIFEXITED(wait_status)) {
    return absl::StrCat("rank ", rank, " exited with status ",
                        WEXITSTATUS(wait_status));
  }
  const int signal_number = WTERMSIG(wait_status);
  std::string description =
      absl::StrCat("rank ", rank, " killed by signal ", signal_number, " (",
                   strsignal(signal_number), ")");
  if (WCOREDUMP(wait_status)) absl::StrAppend(&description, " (core dumped)");
  if (killed_by_launcher && signal_number == SIGKILL) {
    absl::StrAppend(&description, " after not stopping within ",
                    absl::FormatDuration(stop_grace));
  }
  return description;
}

struct RankProcess {
  pid_t pid;
  bool running;
  bool killed_by_launcher;
};

// A rank's exit as a status: INVALID_ARGUMENT for the usage status (2: the
// rank refused its configuration), so the launcher exits as that rank did;
// INTERNAL otherwise.
absl::Status ExitStatus(int rank, int wait_status, bool killed_by_launcher,
                        absl::Duration stop_grace) {
  std::string description =
      DescribeExit(rank, wait_status, killed_by_launcher, stop_grace);
  if (WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 2) {
    return absl::InvalidArgumentError(std::move(description));
  }
  return absl::InternalError(std::move(description));
}

// Starts the ranks and supervises them until all have exited.
class RankGroup {
 public:
  RankGroup(const LaunchOptions& options, int master_port)
      : options_(options),
        master_port_(master_port),
        tagger_(options.json_output) {}

  absl::Status Run() {
    Log(LogLevel::kInfo,
        absl::StrCat("launching ", options_.nproc, " ranks of ",
                     options_.executable, " (MASTER_ADDR=",
                     options_.master_addr, " MASTER_PORT=", master_port_,
                     "): ", absl::StrJoin(options_.args, " ")));
    for (int rank = 0; rank < options_.nproc; ++rank) {
      absl::StatusOr<pid_t> pid = Spawn(rank);
      if (!pid.ok()) {
        Log(LogLevel::kError, pid.status().ToString());
        result_ = pid.status();
        BeginStop(SIGTERM);
        break;
      }
      ranks_.push_back({*pid, true, false});
    }
    tagger_.Start();
    Supervise();
    tagger_.Finish();
    return result_;
  }

 private:
  absl::StatusOr<pid_t> Spawn(int rank) {
    int stdout_pipe[2], stderr_pipe[2];
    if (pipe2(stdout_pipe, O_CLOEXEC) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("pipe for rank ", rank));
    }
    if (pipe2(stderr_pipe, O_CLOEXEC) != 0) {
      const int pipe_errno = errno;
      close(stdout_pipe[0]);
      close(stdout_pipe[1]);
      return absl::ErrnoToStatus(pipe_errno,
                                 absl::StrCat("pipe for rank ", rank));
    }
    const ExecStrings exec_argv(options_.args);
    const ExecStrings exec_envp(RankEnvironment(
        rank, options_.nproc, options_.master_addr, master_port_));
    const std::string exec_failure = absl::StrCat(
        "tally launcher: cannot execute ", options_.executable, "\n");
    const pid_t launcher_pid = getpid();
    const pid_t pid = fork();
    if (pid == 0) {
      ExecRank(options_.executable.c_str(), exec_argv.get(), exec_envp.get(),
               stdout_pipe[1], stderr_pipe[1], launcher_pid, exec_failure);
    }
    const int fork_errno = errno;
    close(stdout_pipe[1]);
    close(stderr_pipe[1]);
    if (pid < 0) {
      close(stdout_pipe[0]);
      close(stderr_pipe[0]);
      return absl::ErrnoToStatus(fork_errno,
                                 absl::StrCat("fork for rank ", rank));
    }
    tagger_.AddStream(rank, stdout_pipe[0], STDOUT_FILENO);
    tagger_.AddStream(rank, stderr_pipe[0], STDERR_FILENO);
    return pid;
  }

  void Supervise() {
    while (true) {
      ReapExited();
      if (std::none_of(ranks_.begin(), ranks_.end(),
                       [](const RankProcess& r) { return r.running; })) {
        return;
      }
      absl::Duration wait = kPollInterval;
      if (stopping_ && !killed_) {
        const absl::Duration until_kill = kill_deadline_ - absl::Now();
        if (until_kill <= absl::ZeroDuration()) {
          KillSurvivors();
        } else {
          wait = std::min(wait, until_kill);
        }
      }
      const sigset_t signals = LauncherSignals();
      const timespec timeout = absl::ToTimespec(wait);
      const int signal_number = sigtimedwait(&signals, nullptr, &timeout);
      if (signal_number == SIGINT || signal_number == SIGTERM) {
        Log(LogLevel::kWarning,
            absl::StrCat("received ", strsignal(signal_number),
                         "; forwarding it to the ranks"));
        SignalRunning(signal_number);
        BeginStop(0);
      }
    }
  }

  void ReapExited() {
    for (size_t rank = 0; rank < ranks_.size(); ++rank) {
      RankProcess& process = ranks_[rank];
      if (!process.running) continue;
      int wait_status = 0;
      const pid_t reaped = waitpid(process.pid, &wait_status, WNOHANG);
      if (reaped == 0 || (reaped < 0 && errno == EINTR)) continue;
      process.running = false;
      if (reaped > 0 && WIFEXITED(wait_status) &&
          WEXITSTATUS(wait_status) == 0) {
        Log(LogLevel::kInfo,
            absl::StrCat("rank ", rank, " exited with status 0"));
        continue;
      }
      const absl::Status failure =
          reaped < 0
              ? absl::ErrnoToStatus(errno,
                                    absl::StrCat("waitpid for rank ", rank))
              : ExitStatus(static_cast<int>(rank), wait_status,
                           process.killed_by_launcher, options_.stop_grace);
      if (stopping_) {
        Log(LogLevel::kWarning, failure.message());
      } else {
        Log(LogLevel::kError,
            absl::StrCat(failure.message(), "; stopping the other ranks"));
      }
      if (result_.ok()) result_ = failure;
      BeginStop(SIGTERM);
    }
  }

  // Starts the stop_grace countdown (once) after sending `signal_number`
  // (0: already sent) to the running ranks.
  void BeginStop(int signal_number) {
    if (stopping_) return;
    stopping_ = true;
    if (signal_number != 0) SignalRunning(signal_number);
    kill_deadline_ = absl::Now() + options_.stop_grace;
  }

  void KillSurvivors() {
    killed_ = true;
    std::vector<int> survivors;
    for (size_t rank = 0; rank < ranks_.size(); ++rank) {
      if (!ranks_[rank].running) continue;
      ranks_[rank].killed_by_launcher = true;
      survivors.push_back(static_cast<int>(rank));
    }
    Log(LogLevel::kWarning,
        absl::StrCat(survivors.size() == 1 ? "rank " : "ranks ",
                     absl::StrJoin(survivors, ", "), " did not stop within ",
                     absl::FormatDuration(options_.stop_grace),
                     "; sending SIGKILL"));
    SignalRunning(SIGKILL);
  }

  // Only unreaped pids are signalled: a zombie keeps its pid from reuse.
  void SignalRunning(int signal_number) {
    for (const RankProcess& process : ranks_) {
      if (process.running) kill(process.pid, signal_number);
    }
  }

  const LaunchOptions& options_;
  const int master_port_;
  std::vector<RankProcess> ranks_;
  OutputTagger tagger_;
  absl::Status result_;
  bool stopping_ = false;
  bool killed_ = false;
  absl::Time kill_deadline_ = absl::InfiniteFuture();
};

absl::Status ValidateOptions(const LaunchOptions& options) {
  if (options.nproc < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("nproc must be at least 1, got ", options.nproc));
  }
  if (options.executable.empty() ||
      access(options.executable.c_str(), X_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "executable '", options.executable, "' is not an executable file"));
  }
  if (options.args.empty()) {
    return absl::InvalidArgumentError("args is empty: it must hold argv[0]");
  }
  if (options.master_addr.empty()) {
    return absl::InvalidArgumentError("master_addr is empty");
  }
  if (options.master_port < 0 || options.master_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "master_port must be in [0, 65535], got ", options.master_port));
  }
  if (options.stop_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop_grace must not be negative, got ",
                     absl::FormatDuration(options.stop_grace)));
  }
  return absl::OkStatus();
}

// The ranks' MASTER_PORT, once the options are valid.
absl::StatusOr<int> MasterPort(const LaunchOptions& options) {
  TALLY_RETURN_IF_ERROR(ValidateOptions(options));
  if (options.master_port != 0) return options.master_port;
  return PickFreePort(options.master_addr);
}

}  // namespace

absl::Status LaunchAndSupervise(const LaunchOptions& options) {
  const absl::StatusOr<int> master_port = MasterPort(options);
  if (!master_port.ok()) {
    Log(LogLevel::kError, master_port.status().message());
    return master_port.status();
  }
  // Blocked before the output thread starts, so that it inherits the mask.
  ScopedSignalBlock block_signals;
  return RankGroup(options, *master_port).Run();
}

std::vector<std::string> ArgsForRanks(int argc, const char* const* argv) {
  constexpr absl::string_view kFlag = "--nproc-per-node";
  std::vector<std::string> args = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == kFlag) {
      ++i;  // and its value
    } else if (!absl::StartsWith(arg, absl::StrCat(kFlag, "="))) {
      args.emplace_back(arg);
    }
  }
  return args;
}

absl::StatusOr<int> PickFreePort(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (const int error = getaddrinfo(host.c_str(), "0", &hints, &addresses);
      error != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "master_addr '", host, "' does not resolve: ", gai_strerror(error)));
  }
  const std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owned_addresses(
      addresses, &freeaddrinfo);
  int bind_errno = 0;
  for (const addrinfo* address = addresses; address != nullptr;
       address = address->ai_next) {
    const int fd =
        socket(address->ai_family, address->ai_socktype | SOCK_CLOEXEC,
               address->ai_protocol);
    if (fd < 0) {
      bind_errno = errno;
      continue;
    }
    sockaddr_storage bound{};
    socklen_t bound_length = sizeof bound;
    int port = 0;
    if (bind(fd, address->ai_addr, address->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_length) ==
            0) {
      port = ntohs(bound.ss_family == AF_INET6
                       ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                       : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    } else {
      bind_errno = errno;
    }
    close(fd);
    if (port > 0) return port;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("cannot bind a port on master_addr '", host,
                   "': ", std::strerror(bind_errno)));
}

}  // namespace tally
