// tally-server: see `tally-server --help` and docs/architecture.md.
#include <csignal>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "runtime/log.h"
#include "server/flags.h"
#include "server/server.h"

int main(int argc, char** argv) {
  absl::StatusOr<tally::ParsedFlags> flags =
      tally::ParseServerFlags(argc, argv);
  if (!flags.ok()) {
    std::cerr << "tally-server: " << flags.status().message() << "\n";
    return 2;
  }
  if (flags->help) {
    std::cout << tally::ServerUsage();
    return 0;
  }
  tally::SetLogLevel(*tally::ParseLogLevel(flags->options.log_level));

  // Block the shutdown signals before any thread starts, so every thread
  // inherits the mask and sigwait below is their only receiver.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<tally::TallyServer>> server =
      tally::TallyServer::Start(flags->options);
  if (!server.ok()) {
    tally::Log(tally::LogLevel::kError,
               absl::StrCat("cannot start: ", server.status().ToString()));
    return 1;
  }
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  tally::Log(tally::LogLevel::kInfo,
             absl::StrCat("received ", strsignal(signal_number)));
  (*server)->Shutdown();
  return 0;
}
