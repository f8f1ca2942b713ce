// tally-server: see `tally-server --help` and docs/architecture.md.
//
// Exit status: 0 after a clean shutdown; 2 when it refuses its command line
// or configuration (an unknown flag, a missing or bad flag value, flags that
// contradict each other, a file a flag names that cannot be read, a rank
// environment that does not fit the mesh); 1 on any other failure (a busy
// port, a failed rendezvous, a dead rank, an overrun --exit-timeout-secs).
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/log.h"
#include "server/deterministic_serialization.h"
#include "server/flags.h"
#include "server/launcher.h"
#include "server/server.h"
#if TALLY_WITH_NCCL
#include "runtime/cuda/nccl_communicator.h"
#endif

namespace {

// libgomp reads OMP_WAIT_POLICY once, when it loads (before main). Its
// default spins idle OpenMP threads, which then take the cores from BLIS's
// threads: 2-thread ForwardBackward ran 0.8x slower than with PASSIVE
// (docs/performance.md). Unless the environment chose, set PASSIVE and
// execute this binary again, once, before any thread starts.
void ExecAgainWithPassiveOpenMp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/1);
  execv("/proc/self/exe", argv);
  // Still here: exec failed; run on with libgomp's default.
}

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// Why a rank 0 (or, through the launcher, any rank) could not start:
// INVALID_ARGUMENT is its configuration.
int StartFailureExitCode(const absl::Status& status) {
  return status.code() == absl::StatusCode::kInvalidArgument ? kExitUsage
                                                             : kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  ExecAgainWithPassiveOpenMp(argv);
#if TALLY_WITH_NCCL
  tally::InstallNcclCommunicators();  // --device cuda: NCCL data groups
#endif
  // A retry gets the bytes its first execution's caller got.
  tally::MakeSerializationDeterministic();
  absl::StatusOr<tally::ParsedFlags> flags =
      tally::ParseServerFlags(argc, argv);
  if (!flags.ok()) {
    std::cerr << "tally-server: " << flags.status().message() << "\n";
    return kExitUsage;
  }
  if (flags->help) {
    std::cout << tally::ServerUsage();
    return 0;
  }
  if (flags->version) {
    std::cout << "tally-server " << TALLY_VERSION << "\n";
    return 0;
  }
  const tally::ServerOptions& options = flags->options;
  tally::SetLogLevel(*tally::ParseLogLevel(options.log_level));
  const tally::LogFormat log_format =
      *tally::ParseLogFormat(options.log_format);
  tally::SetLogFormat(log_format);

  // Block the shutdown signals before any thread starts, so every thread
  // inherits the mask and sigwait below (or the launcher) is their only
  // receiver.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (options.nproc_per_node > 1) {
    tally::LaunchOptions launch;
    launch.nproc = options.nproc_per_node;
    launch.args = tally::ArgsForRanks(argc, argv);
    if (options.rank_env.master_addr) {
      launch.master_addr = *options.rank_env.master_addr;
    }
    if (options.rank_env.master_port) {
      launch.master_port = *options.rank_env.master_port;
    }
    // Rank 0 drains and finishes its requests before the ranks exit.
    launch.stop_grace = absl::Seconds(options.shutdown_drain_secs +
                                      options.exit_timeout_secs + 10);
    launch.json_output = log_format == tally::LogFormat::kJson;
    // Its failures are already logged, each once. A rank that refused its
    // configuration (exit 2) makes the launcher exit 2 as well.
    const absl::Status launched = tally::LaunchAndSupervise(launch);
    return launched.ok() ? 0 : StartFailureExitCode(launched);
  }

  absl::StatusOr<std::unique_ptr<tally::Engine>> engine =
      tally::CreateRankEngine(options);
  if (!engine.ok()) {
    tally::Log(tally::LogLevel::kError,
               absl::StrCat("cannot start: ", engine.status().ToString()));
    return StartFailureExitCode(engine.status());
  }
  if ((*engine)->mesh().rank() != 0) {
    // Ranks > 0 ignore SIGTERM (it stays blocked): they stop when rank 0,
    // having drained its requests, replicates the shutdown command.
    absl::Status status = tally::ServeWorkerRank(options, *std::move(engine));
    if (!status.ok()) {
      tally::Log(tally::LogLevel::kError,
                 absl::StrCat("rank: ", status.ToString()));
      return 1;
    }
    return 0;
  }
  absl::StatusOr<std::unique_ptr<tally::TallyServer>> server =
      tally::TallyServer::Start(options, *std::move(engine));
  if (!server.ok()) {
    tally::Log(tally::LogLevel::kError,
               absl::StrCat("cannot start: ", server.status().ToString()));
    return StartFailureExitCode(server.status());
  }
  // Until a signal, or a failed collective (a dead or hung rank), after
  // which the process must exit for its supervisor to restart the group.
  int signal_number = -1;
  while (signal_number < 0 && (*server)->failure().ok()) {
    const timespec tick = {0, 100'000'000};
    signal_number = sigtimedwait(&signals, nullptr, &tick);
  }
  if (signal_number > 0) {
    tally::Log(tally::LogLevel::kInfo,
               absl::StrCat("received ", strsignal(signal_number)));
  }
  // Whatever the shutdown waits on (a hung collective, a slow command), the
  // process is gone within --exit-timeout-secs.
  std::thread([timeout = absl::Seconds(options.exit_timeout_secs)] {
    absl::SleepFor(timeout);
    tally::Log(tally::LogLevel::kError,
               absl::StrCat("shutdown overran --exit-timeout-secs (",
                            absl::FormatDuration(timeout), "); exiting 1"));
    _exit(1);
  }).detach();
  const absl::Status failure = (*server)->Shutdown();
  return failure.ok() ? 0 : 1;
}
