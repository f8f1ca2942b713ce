// ServerProcess: runs a real tally-server binary as a child process for
// end-to-end tests. It listens on 127.0.0.1 with OS-chosen ports, which it
// learns from the server's --port-file, keeps the server's output in a log
// that every error quotes, and stops it with SIGTERM as an orchestrator would.
// Header-only so each tests/e2e/*_test.cc binary can use it without a helper
// library.
//
//   absl::StatusOr<std::unique_ptr<tally::testing::ServerProcess>> server =
//       tally::testing::ServerProcess::Start(
//           tally::testing::ServerBinaryFromEnv(), {"--demo-model"});
//   ASSERT_TRUE(server.ok()) << server.status();
//   tally::TrainerClientOptions options;
//   options.target = (*server)->grpc_target();
//   ...
//   absl::StatusOr<int> exit_code = (*server)->Stop(absl::Seconds(30));
//   EXPECT_EQ(exit_code.value_or(-1), 0);
#ifndef TALLY_TESTS_E2E_SERVER_PROCESS_H_
#define TALLY_TESTS_E2E_SERVER_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tally::testing {

// $TALLY_SERVER, the tally-server binary tests/CMakeLists.txt passes to every
// e2e test; an empty string when unset, which Start reports.
inline std::string ServerBinaryFromEnv() {
  const char* path = std::getenv("TALLY_SERVER");
  return path == nullptr ? "" : path;
}

class ServerProcess {
 public:
  // Launches `binary --host 127.0.0.1 --grpc-port 0 --metrics-port 0
  // --port-file <scratch>/ports.json <extra_args...>` and waits until the port
  // file appears (the server writes it once SERVING). FAILED_PRECONDITION with
  // the server's log if it exits first, DEADLINE_EXCEEDED (after SIGKILL) if
  // it is still silent after `startup_timeout`.
  // `address_space_bytes` > 0 caps the server's virtual memory (RLIMIT_AS,
  // like `prlimit --as`): an allocation past it fails at once.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::string& binary, const std::vector<std::string>& extra_args,
      absl::Duration startup_timeout = absl::Seconds(60),
      uint64_t address_space_bytes = 0) {
    if (binary.empty()) {
      return absl::FailedPreconditionError(
          "TALLY_SERVER is not set; it must name the tally-server binary");
    }
    if (access(binary.c_str(), X_OK) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("TALLY_SERVER=", binary, " is not an executable file"));
    }
    std::string scratch =
        (std::filesystem::temp_directory_path() / "tally-e2e-XXXXXX").string();
    if (mkdtemp(scratch.data()) == nullptr) {
      return absl::ErrnoToStatus(errno, "mkdtemp for the server's files");
    }
    std::unique_ptr<ServerProcess> server(new ServerProcess(scratch));
    std::vector<std::string> args = {binary, "--host", "127.0.0.1"};
    args.insert(args.end(), {"--grpc-port", "0", "--metrics-port", "0"});
    args.insert(args.end(), {"--port-file", server->port_file_path()});
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    if (absl::Status spawned = server->Spawn(args, address_space_bytes);
        !spawned.ok()) {
      return spawned;
    }
    if (absl::Status ready = server->AwaitPortFile(startup_timeout);
        !ready.ok()) {
      return ready;
    }
    return server;
  }

  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  // A server that was never stopped (a failed test) is killed, not leaked.
  ~ServerProcess() {
    if (running()) {
      kill(pid_, SIGKILL);
      int status = 0;
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
    std::error_code ignored;
    std::filesystem::remove_all(scratch_dir_, ignored);
  }

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  std::string grpc_target() const {
    return absl::StrCat("127.0.0.1:", grpc_port_);
  }
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !exit_status_.has_value(); }

  // SIGTERM, then up to `timeout` for the server to exit: its exit code;
  // INTERNAL if a signal killed it; DEADLINE_EXCEEDED (after SIGKILL) if it
  // hangs. Calling it again returns the first answer.
  absl::StatusOr<int> Stop(absl::Duration timeout) {
    if (!running()) return Outcome();
    if (kill(pid_, SIGTERM) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("kill -TERM ", pid_));
    }
    const absl::Time give_up = absl::Now() + timeout;
    while (!Reap(/*block=*/false)) {
      if (absl::Now() >= give_up) {
        kill(pid_, SIGKILL);
        Reap(/*block=*/true);
        return absl::DeadlineExceededError(
            absl::StrCat("tally-server (pid ", pid_, ") still running ",
                         absl::FormatDuration(timeout),
                         " after SIGTERM; killed it. Log:\n", ReadLog()));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return Outcome();
  }

  // Everything the server wrote to stdout and stderr so far.
  std::string ReadLog() const {
    std::ifstream in(log_path());
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }

  // A directory that lives (and is deleted) with this object, for the test's
  // own files such as checkpoints.
  const std::string& scratch_dir() const { return scratch_dir_; }

 private:
  explicit ServerProcess(std::string scratch_dir)
      : scratch_dir_(std::move(scratch_dir)) {}

  std::string port_file_path() const { return scratch_dir_ + "/ports.json"; }
  std::string log_path() const { return scratch_dir_ + "/server.log"; }

  // fork + exec rather than posix_spawn for PR_SET_PDEATHSIG: a test binary
  // that dies (a crash, a ctest timeout) takes its servers along instead of
  // leaving them running. The death signal follows the thread that forks, so
  // Start must run on one that outlives the server (a test's main thread).
  absl::Status Spawn(const std::vector<std::string>& args,
                     uint64_t address_space_bytes) {
    // The child may only make async-signal-safe calls, so everything it needs
    // is prepared here.
    std::vector<char*> argv;
    for (const std::string& arg : args) {
      argv.push_back(const_cast<char*>(arg.c_str()));
    }
    argv.push_back(nullptr);
    const std::string log = log_path();
    // Closed by a successful exec; otherwise it carries exec's errno back.
    int exec_error[2];
    if (pipe2(exec_error, O_CLOEXEC) != 0) {
      return absl::ErrnoToStatus(errno, "pipe2");
    }
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ < 0) {
      const int error = errno;
      close(exec_error[0]);
      close(exec_error[1]);
      return absl::ErrnoToStatus(error, "fork");
    }
    if (pid_ == 0) {
      close(exec_error[0]);
      ExecServer(argv.data(), log.c_str(), parent, exec_error[1],
                 address_space_bytes);
    }
    close(exec_error[1]);
    int child_errno = 0;
    ssize_t received;
    do {
      received = read(exec_error[0], &child_errno, sizeof child_errno);
    } while (received < 0 && errno == EINTR);
    close(exec_error[0]);
    if (received > 0) {
      Reap(/*block=*/true);
      return absl::ErrnoToStatus(child_errno, absl::StrCat("exec ", args[0]));
    }
    return absl::OkStatus();
  }

  // The child's side of Spawn: output into `log`, default signal handling,
  // then exec; reports exec's errno on `error_pipe` if it fails.
  [[noreturn]] static void ExecServer(char* const* argv, const char* log,
                                      pid_t parent, int error_pipe,
                                      uint64_t address_space_bytes) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (address_space_bytes > 0) {
      const rlimit limit{address_space_bytes, address_space_bytes};
      if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(126);
    }
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    const int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      if (fd > STDERR_FILENO) close(fd);
    }
    // The server blocks SIGTERM itself and sigwaits for it; it starts from
    // default handlers and an empty mask whatever this process set up.
    struct sigaction default_action = {};
    default_action.sa_handler = SIG_DFL;
    for (int signal_number : {SIGTERM, SIGINT, SIGPIPE}) {
      sigaction(signal_number, &default_action, nullptr);
    }
    sigset_t no_signals;
    sigemptyset(&no_signals);
    sigprocmask(SIG_SETMASK, &no_signals, nullptr);
    execv(argv[0], argv);
    const int error = errno;
    [[maybe_unused]] const ssize_t written =
        write(error_pipe, &error, sizeof error);
    _exit(127);
  }

  absl::Status AwaitPortFile(absl::Duration timeout) {
    const absl::Time give_up = absl::Now() + timeout;
    while (true) {
      // The server writes a temporary file and renames it, so a port file
      // that exists is complete.
      std::ifstream in(port_file_path());
      if (in) {
        std::ostringstream text;
        text << in.rdbuf();
        if (ParsePort(text.str(), "grpc_port", &grpc_port_) &&
            ParsePort(text.str(), "metrics_port", &metrics_port_)) {
          return absl::OkStatus();
        }
        return absl::InternalError(absl::StrCat(
            "unreadable port file ", port_file_path(), ": '", text.str(), "'"));
      }
      if (Reap(/*block=*/false)) {
        return absl::FailedPreconditionError(
            absl::StrCat("tally-server exited before serving (", DescribeExit(),
                         "). Log:\n", ReadLog()));
      }
      if (absl::Now() >= give_up) {
        kill(pid_, SIGKILL);
        Reap(/*block=*/true);
        return absl::DeadlineExceededError(absl::StrCat(
            "tally-server wrote no port file within ",
            absl::FormatDuration(timeout), "; killed it. Log:\n", ReadLog()));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // `"key": N` in the one-line JSON object of the port file.
  static bool ParsePort(const std::string& json, const std::string& key,
                        int* port) {
    const std::string quoted = absl::StrCat("\"", key, "\"");
    size_t at = json.find(quoted);
    if (at == std::string::npos) return false;
    at = json.find(':', at + quoted.size());
    if (at == std::string::npos) return false;
    ++at;
    while (at < json.size() &&
           std::isspace(static_cast<unsigned char>(json[at]))) {
      ++at;
    }
    size_t end = at;
    while (end < json.size() &&
           std::isdigit(static_cast<unsigned char>(json[end]))) {
      ++end;
    }
    return absl::SimpleAtoi(json.substr(at, end - at), port) && *port > 0;
  }

  // Collects the exit status if the child has exited (waiting for it when
  // `block`); true once it has.
  bool Reap(bool block) {
    if (exit_status_.has_value()) return true;
    int status = 0;
    pid_t done;
    do {
      done = waitpid(pid_, &status, block ? 0 : WNOHANG);
    } while (done < 0 && errno == EINTR);
    if (done != pid_) return false;
    exit_status_ = status;
    return true;
  }

  std::string DescribeExit() const {
    if (WIFEXITED(*exit_status_)) {
      return absl::StrCat("exit code ", WEXITSTATUS(*exit_status_));
    }
    if (WIFSIGNALED(*exit_status_)) {
      return absl::StrCat("killed by signal ", WTERMSIG(*exit_status_), " (",
                          strsignal(WTERMSIG(*exit_status_)), ")");
    }
    return absl::StrCat("wait status ", *exit_status_);
  }

  absl::StatusOr<int> Outcome() const {
    if (!exit_status_.has_value()) {
      return absl::FailedPreconditionError("tally-server was never started");
    }
    if (WIFEXITED(*exit_status_)) return WEXITSTATUS(*exit_status_);
    return absl::InternalError(
        absl::StrCat("tally-server ", DescribeExit(), ". Log:\n", ReadLog()));
  }

  std::string scratch_dir_;
  pid_t pid_ = -1;
  std::optional<int> exit_status_;  // waitpid's status once reaped
  int grpc_port_ = 0;
  int metrics_port_ = 0;
};

}  // namespace tally::testing

#endif  // TALLY_TESTS_E2E_SERVER_PROCESS_H_
