#include "server/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/file_text.h"
#include "server/convert.h"

namespace tally {
namespace {

std::string Sha256(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(data.data(), data.size(), digest, &size, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(digest), size);
}

}  // namespace

absl::StatusOr<BasicCredentials> BasicCredentials::FromFile(
    const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileText(path, "metrics auth file");
  if (!text.ok()) return text.status();
  return FromText(*text, path);
}

absl::StatusOr<BasicCredentials> BasicCredentials::FromText(
    absl::string_view text, const std::string& source) {
  const absl::string_view line = absl::StripAsciiWhitespace(text);
  const size_t colon = line.find(':');
  if (line.find('\n') != absl::string_view::npos ||
      colon == absl::string_view::npos || colon == 0 ||
      colon + 1 == line.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": expected one line '<user>:<password>', both non-empty"));
  }
  return BasicCredentials(Sha256(line));
}

bool BasicCredentials::Matches(absl::string_view user,
                               absl::string_view password) const {
  // HTTP Basic ends the user at the first colon; one that holds a colon
  // would make "<user>:<password>" ambiguous.
  if (user.find(':') != absl::string_view::npos) return false;
  const std::string digest = Sha256(absl::StrCat(user, ":", password));
  return digest.size() == digest_.size() &&
         CRYPTO_memcmp(digest.data(), digest_.data(), digest.size()) == 0;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(
    const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileText(path, "tokens file");
  if (!text.ok()) return text.status();
  return FromText(*text, path);
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromText(
    absl::string_view text, const std::string& source) {
  std::unique_ptr<Authenticator> auth(new Authenticator());
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || absl::StartsWith(line, "#")) continue;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat(source, ":", line_number);
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected '<token> <tenant>'"));
    }
    const std::string tenant(fields[1]);
    if (absl::Status valid = ValidateModelId(tenant, "tenant"); !valid.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", valid.message()));
    }
    if (!auth->tenant_by_token_digest_.emplace(Sha256(fields[0]), tenant)
             .second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token of this line appears earlier"));
    }
  }
  if (auth->tenant_by_token_digest_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, " holds no token"));
  }
  return auth;
}

absl::StatusOr<std::string> Authenticator::Authenticate(
    std::optional<absl::string_view> authorization) const {
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        "missing 'authorization: Bearer <token>' metadata");
  }
  constexpr absl::string_view kScheme = "Bearer ";
  if (!absl::StartsWithIgnoreCase(*authorization, kScheme)) {
    return absl::UnauthenticatedError(
        "the authorization metadata is not 'Bearer <token>'");
  }
  const auto it = tenant_by_token_digest_.find(Sha256(
      absl::StripAsciiWhitespace(authorization->substr(kScheme.size()))));
  if (it == tenant_by_token_digest_.end()) {
    return absl::UnauthenticatedError("unknown bearer token");
  }
  return it->second;
}

}  // namespace tally
