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

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

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
