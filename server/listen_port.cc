#include "server/listen_port.h"

#include <netdb.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/scoped_fd.h"

namespace tally {
namespace {

// 0 when a socket of `address` binds, else the errno that stopped it.
int TryBind(const addrinfo& address) {
  ScopedFd fd(::socket(address.ai_family, address.ai_socktype | SOCK_CLOEXEC,
                       address.ai_protocol));
  if (fd.get() < 0) return errno;
  const int on = 1;
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0) {
    return errno;
  }
  return ::bind(fd.get(), address.ai_addr, address.ai_addrlen) == 0 ? 0 : errno;
}

}  // namespace

absl::Status CheckCanListen(const std::string& host, int port,
                            absl::string_view flag) {
  if (port == 0) return absl::OkStatus();
  // "[::1]" as gRPC takes it; getaddrinfo wants the bare address.
  absl::string_view name = host;
  if (absl::ConsumePrefix(&name, "[")) absl::ConsumeSuffix(&name, "]");
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* addresses = nullptr;
  const std::string service = absl::StrCat(port);
  const int resolved = ::getaddrinfo(std::string(name).c_str(), service.c_str(),
                                     &hints, &addresses);
  if (resolved != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--host ", host, ": cannot resolve it: ", gai_strerror(resolved)));
  }
  int error = 0;
  for (const addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    error = TryBind(*a);
    if (error == 0) break;
  }
  freeaddrinfo(addresses);
  if (error == 0) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      flag, ": cannot listen on ", host, ":", port, ": ", std::strerror(error),
      error == EADDRINUSE
          ? absl::StrCat(" (another process holds the port; choose another ",
                         flag, ", or 0 for a free one)")
          : ""));
}

}  // namespace tally
