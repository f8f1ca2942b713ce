// Command-line flags of tally-server (kebab-case, `--name=value` or
// `--name value`; booleans also as a bare `--name`, or `=true` / `=false`).
// They are absl flags named in snake_case (`--grpc-port` is
// FLAGS_grpc_port in server/flags.cc); only tally-server's own are accepted.
//
//   absl::StatusOr<tally::ParsedFlags> flags =
//       tally::ParseServerFlags(argc, argv);
//   if (flags.ok() && flags->help) { std::cout << tally::ServerUsage(); }
#ifndef TALLY_SERVER_FLAGS_H_
#define TALLY_SERVER_FLAGS_H_

#include <string>

#include "absl/status/statusor.h"
#include "server/server.h"

namespace tally {

struct ParsedFlags {
  ServerOptions options;
  bool help = false;
  bool version = false;  // --version: print "tally-server <version>"
};

// INVALID_ARGUMENT naming the flag for unknown flags and bad values. Each
// call first resets tally-server's absl flags to their defaults, then sets
// them from `argv`, so calls do not see each other's flags; calls must not
// overlap (the flags are the process's).
absl::StatusOr<ParsedFlags> ParseServerFlags(int argc, const char* const* argv);
// The --help text: the flags by section, each with its value name, help and
// default (all from the registered flags).
std::string ServerUsage();

}  // namespace tally

#endif  // TALLY_SERVER_FLAGS_H_
