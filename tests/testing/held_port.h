// HeldPort: a TCP socket bound to 127.0.0.1 at a port the kernel picked, so a
// test can hand a port it knows is taken to the code under test (no race: the
// port is held from the moment it is chosen until the object dies).
// Header-only, for the unit tests and the e2e binaries alike.
//
//   tally::testing::HeldPort held;  // listening
//   ASSERT_GT(held.port(), 0);
//   ... start tally-server --grpc-port held.port(), expect a refusal ...
#ifndef TALLY_TESTS_TESTING_HELD_PORT_H_
#define TALLY_TESTS_TESTING_HELD_PORT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "base/scoped_fd.h"

namespace tally::testing {

class HeldPort {
 public:
  // Listening unless `listen` is false; then bound with SO_REUSEADDR only,
  // as the socket of a connection that is closing is.
  explicit HeldPort(bool listen = true)
      : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    const int on = 1;
    if (!listen) {
      ::setsockopt(fd_.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    }
    sockaddr_in address = {};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    auto* raw = reinterpret_cast<sockaddr*>(&address);
    if (fd_.get() >= 0 && ::bind(fd_.get(), raw, sizeof address) == 0 &&
        (!listen || ::listen(fd_.get(), 1) == 0) &&
        ::getsockname(fd_.get(), raw, &length) == 0) {
      port_ = ntohs(address.sin_port);
    }
  }

  // 0 when the socket could not be set up.
  int port() const { return port_; }

 private:
  ScopedFd fd_;
  int port_ = 0;
};

}  // namespace tally::testing

#endif  // TALLY_TESTS_TESTING_HELD_PORT_H_
