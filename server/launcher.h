// The local launcher of tally-server's rank processes (what torchrun does for
// PyTorch): `tally-server --nproc-per-node N ...` starts N copies of itself on
// this machine with the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), prefixes their output lines
// with "[rank r] " (or keeps them JSON), and supervises them: the first rank
// that fails stops the others and names itself in the returned status.
//
//   tally::LaunchOptions launch;  // ranks run this very binary
//   launch.nproc = 4;
//   launch.args = tally::ArgsForRanks(argc, argv);
//   absl::Status status = tally::LaunchAndSupervise(launch);
//   // e.g. INTERNAL "rank 2 exited with status 3"
//
// Signals: SIGINT and SIGTERM must be blocked in every thread of the process
// (block them in main() before any thread starts, as tally-server does) so
// that the launcher, which waits for them with sigtimedwait, is their only
// receiver. LaunchAndSupervise blocks them (and SIGCHLD) in the calling thread
// itself and restores that thread's mask on return.
#ifndef TALLY_SERVER_LAUNCHER_H_
#define TALLY_SERVER_LAUNCHER_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tally {

struct LaunchOptions {
  int nproc = 1;
  // The program each rank runs. The default is the running binary itself,
  // through its /proc link, which still works after its file was replaced
  // (a rebuild or an upgrade during the run): ranks run the launcher's code.
  std::string executable = "/proc/self/exe";
  // The ranks' argv, argv[0] included (what ps shows).
  std::vector<std::string> args;
  std::string master_addr = "127.0.0.1";
  // 0: a free port on master_addr, chosen by the OS.
  int master_port = 0;
  // How long ranks may take to exit after SIGTERM before they get SIGKILL.
  absl::Duration stop_grace = absl::Seconds(10);
  // The ranks log JSON (--log-format json): their lines pass as they are,
  // a line that is not a JSON object is wrapped into one of its rank, and
  // none gets the "[rank r] " prefix.
  bool json_output = false;
};

// Starts options.nproc ranks and waits for all of them. Rank r gets RANK=r,
// LOCAL_RANK=r, WORLD_SIZE=LOCAL_WORLD_SIZE=nproc, MASTER_ADDR and MASTER_PORT
// (replacing inherited values; the rest of the environment is inherited), an
// empty signal mask, and dies with the calling thread (PR_SET_PDEATHSIG).
//
// OK when every rank exits 0, including after a SIGINT/SIGTERM sent to the
// launcher, which forwards it to every rank. When a rank exits non-zero or is
// killed by a signal, the other ranks get SIGTERM, then SIGKILL after
// stop_grace, and the result is INTERNAL naming the first failed rank and its
// exit status or signal. INVALID_ARGUMENT names a bad option. Every failure
// it returns was logged when the launcher met it.
absl::Status LaunchAndSupervise(const LaunchOptions& options);

// argv without the launcher's own `--nproc-per-node N` /
// `--nproc-per-node=N`, which must not reach the ranks.
std::vector<std::string> ArgsForRanks(int argc, const char* const* argv);

// A TCP port that is free on `host` right now (bind port 0, read it back,
// close). INVALID_ARGUMENT naming master_addr if `host` does not resolve.
absl::StatusOr<int> PickFreePort(const std::string& host);

}  // namespace tally

#endif  // TALLY_SERVER_LAUNCHER_H_
