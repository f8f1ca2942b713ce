// CheckCanListen: whether this process can listen on host:port, asked before
// gRPC and the metrics endpoint bind their ports, so that a port another
// process holds stops the server with one line naming the port and its flag
// instead of gRPC's raw bind error or CivetServer's "null context". The
// binder still reports the rare port taken between the check and the bind.
//
//   TALLY_RETURN_IF_ERROR(tally::CheckCanListen("0.0.0.0", 50051,
//                                               "--grpc-port"));
//   // UNAVAILABLE "--grpc-port: cannot listen on 0.0.0.0:50051: Address
//   // already in use (...)" while another process listens there.
#ifndef TALLY_SERVER_LISTEN_PORT_H_
#define TALLY_SERVER_LISTEN_PORT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tally {

// OK when `port` is 0 (any free port) or when a TCP socket binds `port` on at
// least one address `host` resolves to (as gRPC needs; SO_REUSEADDR, so
// connections closing there do not count), and the socket is closed again.
// UNAVAILABLE naming `flag`, the address and the reason when none binds;
// INVALID_ARGUMENT naming --host when `host` does not resolve.
absl::Status CheckCanListen(const std::string& host, int port,
                            absl::string_view flag);

}  // namespace tally

#endif  // TALLY_SERVER_LISTEN_PORT_H_
