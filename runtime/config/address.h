// Host names and addresses as the server and the rendezvous judge them.
//
//   if (!tally::IsLoopbackHost(options.host) && !tls) return Refuse();
#ifndef TALLY_RUNTIME_CONFIG_ADDRESS_H_
#define TALLY_RUNTIME_CONFIG_ADDRESS_H_

#include "absl/strings/string_view.h"

namespace tally {

// True for "localhost", an IPv4 address in 127.0.0.0/8 written as a dotted
// quad, and the IPv6 loopback ::1 (also bracketed, "[::1]", and as the
// IPv4-mapped ::ffff:127.x.y.z). Nothing else: "127.evil.example" and
// "127.0.0.1.nip.io" are names that may resolve anywhere.
bool IsLoopbackHost(absl::string_view host);

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_ADDRESS_H_
