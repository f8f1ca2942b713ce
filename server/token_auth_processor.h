// TokenAuthProcessor: bearer tokens checked by gRPC's own auth layer, from a
// call's metadata alone, before its body is read into a request message.
//
// TrainerService authenticates every call too, but only once gRPC has parsed
// the body: without this processor an unauthenticated client can make the
// server parse a body of up to --max-message-bytes. gRPC runs an
// AuthMetadataProcessor for calls on a secure (TLS) port, so the server
// installs one whenever it serves TLS with --auth-tokens-file. The health
// service and server reflection stay open (the call's :path names the
// method). Plaintext (loopback or --allow-insecure-remote) has no such hook
// in gRPC: there the service's own check is the only one.
//
//   auto credentials = grpc::SslServerCredentials(ssl);
//   credentials->SetAuthMetadataProcessor(std::make_shared<TokenAuthProcessor>(
//       authenticator, [&](const std::string& why) { RecordFailure(why); }));
#ifndef TALLY_SERVER_TOKEN_AUTH_PROCESSOR_H_
#define TALLY_SERVER_TOKEN_AUTH_PROCESSOR_H_

#include <grpcpp/security/auth_metadata_processor.h>

#include <functional>
#include <string>

#include "server/auth.h"

namespace tally {

class TokenAuthProcessor : public grpc::AuthMetadataProcessor {
 public:
  // `authenticator` outlives the processor. `on_failure` gets
  // "missing_token" or "invalid_token" for each refused call.
  TokenAuthProcessor(const Authenticator* authenticator,
                     std::function<void(const std::string& reason)> on_failure)
      : authenticator_(authenticator), on_failure_(std::move(on_failure)) {}

  // Hashing a token does not block: run on the call's own thread.
  bool IsBlocking() const override { return false; }

  // OK for the health and reflection services; otherwise UNAUTHENTICATED
  // unless the "authorization" metadata names a known token. The metadata
  // stays for the service, which maps the token to the tenant.
  grpc::Status Process(const InputMetadata& auth_metadata,
                       grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const Authenticator* authenticator_;
  std::function<void(const std::string& reason)> on_failure_;
};

}  // namespace tally

#endif  // TALLY_SERVER_TOKEN_AUTH_PROCESSOR_H_
