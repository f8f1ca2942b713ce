// Reads a tally server's Prometheus endpoint in end-to-end tests: a plain
// HTTP/1.0 GET and a lookup of one sample in the text exposition.
// Header-only, like the other tests/e2e helpers.
//
//   absl::StatusOr<std::string> text =
//       tally::testing::HttpGet(server->metrics_port(), "/metrics");
//   absl::StatusOr<double> steps = tally::testing::MetricValue(
//       *text, "tally_optim_steps_total", {{"model_id", "m"}});
#ifndef TALLY_TESTS_E2E_METRICS_SCRAPE_H_
#define TALLY_TESTS_E2E_METRICS_SCRAPE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace tally::testing {

// The body of `GET path` from 127.0.0.1:port over HTTP/1.0 (the server
// closes the connection after the response); an error unless it is a 200.
inline absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket");
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  const timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address),
              sizeof address) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("connect 127.0.0.1:", port));
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n =
        send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, "send");
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buffer[16384];
  while (true) {
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, "recv");
    if (n == 0) break;
    response.append(buffer, static_cast<size_t>(n));
  }
  const size_t header_end = response.find("\r\n\r\n");
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (header_end == std::string::npos ||
      status_line.find(" 200 ") == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("GET ", path, " from port ",
                                               port, " answered: '",
                                               response.substr(0, 200), "'"));
  }
  return response.substr(header_end + 4);
}

// The value of the sample of metric `name` whose labels include every pair in
// `labels`, read from Prometheus text exposition. Label values must hold no
// ',' or '}', which is true of tally's (model ids, RPC names, codes).
inline absl::StatusOr<double> MetricValue(
    const std::string& exposition, const std::string& name,
    const std::map<std::string, std::string>& labels) {
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (line.empty() || line.front() == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    if (name_end == absl::string_view::npos ||
        line.substr(0, name_end) != name) {
      continue;
    }
    absl::string_view rest = line.substr(name_end);
    std::map<std::string, std::string> found;
    if (rest.front() == '{') {
      const size_t close = rest.find('}');
      if (close == absl::string_view::npos) continue;
      for (absl::string_view pair :
           absl::StrSplit(rest.substr(1, close - 1), ',', absl::SkipEmpty())) {
        const size_t equals = pair.find('=');
        if (equals == absl::string_view::npos) continue;
        absl::string_view value = pair.substr(equals + 1);
        absl::ConsumePrefix(&value, "\"");
        absl::ConsumeSuffix(&value, "\"");
        found[std::string(pair.substr(0, equals))] = std::string(value);
      }
      rest = rest.substr(close + 1);
    }
    const bool matches =
        std::all_of(labels.begin(), labels.end(), [&](const auto& label) {
          auto it = found.find(label.first);
          return it != found.end() && it->second == label.second;
        });
    if (!matches) continue;
    double value = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(rest), &value)) {
      return absl::DataLossError(
          absl::StrCat("unparsable sample line '", line, "'"));
    }
    return value;
  }
  std::string wanted = name;
  for (const auto& [key, value] : labels) {
    absl::StrAppend(&wanted, " ", key, "=", value);
  }
  return absl::NotFoundError(absl::StrCat("no sample ", wanted));
}

}  // namespace tally::testing

#endif  // TALLY_TESTS_E2E_METRICS_SCRAPE_H_
