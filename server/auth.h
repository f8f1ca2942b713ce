// Authenticator: bearer-token authentication. A tokens file maps each token to
// the tenant it acts for; a request carries "authorization: Bearer <token>"
// metadata. Tenancy itself (scoping model ids) is in convert.h.
//
// Tokens file: one "<token> <tenant>" pair per line; blank lines and lines
// starting with '#' are ignored. Tenants match [A-Za-z0-9._-]{1,128}.
//
//   TALLY_ASSIGN_OR_RETURN(auto auth,
//                          tally::Authenticator::FromFile("/etc/tally/tokens"));
//   absl::StatusOr<std::string> tenant = auth->Authenticate("Bearer s3cret");
#ifndef TALLY_SERVER_AUTH_H_
#define TALLY_SERVER_AUTH_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

// HTTP Basic credentials for /metrics, which names every tenant's models:
// --metrics-auth-file holds one line "<user>:<password>" (Prometheus'
// basic_auth, a PodMonitor's basicAuth secret).
//
//   TALLY_ASSIGN_OR_RETURN(BasicCredentials scraper,
//                          BasicCredentials::FromFile("/etc/tally/metrics"));
//   if (!scraper.Matches(user, password)) return 401;
class BasicCredentials {
 public:
  // INVALID_ARGUMENT naming `source` for anything but one "<user>:<password>"
  // line with both parts non-empty (the password is never echoed).
  static absl::StatusOr<BasicCredentials> FromFile(const std::string& path);
  static absl::StatusOr<BasicCredentials> FromText(absl::string_view text,
                                                   const std::string& source);

  // Compares digests in constant time.
  bool Matches(absl::string_view user, absl::string_view password) const;

 private:
  explicit BasicCredentials(std::string digest) : digest_(std::move(digest)) {}

  std::string digest_;  // SHA-256 of "<user>:<password>"
};

class Authenticator {
 public:
  // INVALID_ARGUMENT naming the line for a malformed line, a bad tenant name
  // or a repeated token (the token itself is never echoed); an empty file is
  // INVALID_ARGUMENT too, since it would lock every client out.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(
      const std::string& path);
  // `source` names the text in errors.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromText(
      absl::string_view text, const std::string& source);

  // The tenant of an "authorization" metadata value; UNAUTHENTICATED when it
  // is absent, not "Bearer <token>" or the token is unknown.
  absl::StatusOr<std::string> Authenticate(
      std::optional<absl::string_view> authorization) const;

 private:
  Authenticator() = default;

  // By SHA-256 of the token: lookups compare digests, so their timing says
  // nothing useful about the tokens.
  std::map<std::string, std::string> tenant_by_token_digest_;
};

}  // namespace tally

#endif  // TALLY_SERVER_AUTH_H_
