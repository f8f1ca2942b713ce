// Command-line flags of tally-server (kebab-case, `--name=value` or
// `--name value`; booleans also as a bare `--name`).
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

// INVALID_ARGUMENT naming the flag for unknown flags and bad values.
absl::StatusOr<ParsedFlags> ParseServerFlags(int argc, const char* const* argv);
std::string ServerUsage();

}  // namespace tally

#endif  // TALLY_SERVER_FLAGS_H_
