// Access control pieces that need no server: the tokens file, bearer-token
// authentication, tenant scoping of model ids, and the flags of checkpoints
// and access control.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/engine/engine.h"
#include "server/auth.h"
#include "server/convert.h"
#include "server/flags.h"

namespace tally {
namespace {

TEST(AuthenticatorTest, MapsBearerTokensToTenants) {
  absl::StatusOr<std::unique_ptr<Authenticator>> auth = Authenticator::FromText(
      "# production tokens\n"
      "tok-alice-0123456789 alice\n"
      "\n"
      "  tok-bob-9876543210\tbob  \n"
      "tok-alice-second alice\n",
      "tokens");
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ((*auth)->Authenticate("Bearer tok-alice-0123456789").value_or(""),
            "alice");
  EXPECT_EQ((*auth)->Authenticate("bearer tok-alice-second").value_or(""),
            "alice");
  EXPECT_EQ((*auth)->Authenticate("Bearer tok-bob-9876543210").value_or(""),
            "bob");
  for (const std::optional<absl::string_view>& bad :
       std::vector<std::optional<absl::string_view>>{
           std::nullopt, "", "Bearer", "Bearer ", "Basic tok-bob-9876543210",
           "Bearer tok-bob-987654321", "Bearer tok-bob-98765432100",
           "tok-bob-9876543210"}) {
    const absl::Status status = (*auth)->Authenticate(bad).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated)
        << bad.value_or("<absent>");
    // Errors never echo what the client sent.
    EXPECT_EQ(std::string(status.message()).find("tok-"), std::string::npos);
  }
}

TEST(AuthenticatorTest, BadTokensFilesAreRefusedNamingTheLine) {
  struct Case {
    const char* text;
    const char* where;
  };
  for (const Case& c :
       std::vector<Case>{{"tok alice extra\n", "f:1"},
                         {"# only\n\ntok-without-tenant\n", "f:3"},
                         {"tok al/ice\n", "f:1"},
                         {"tok1 alice\ntok1 bob\n", "f:2"},
                         {"# nothing\n", "f holds no token"}}) {
    absl::StatusOr<std::unique_ptr<Authenticator>> auth =
        Authenticator::FromText(c.text, "f");
    ASSERT_FALSE(auth.ok()) << c.text;
    EXPECT_EQ(auth.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(auth.status().message()).find(c.where),
              std::string::npos)
        << auth.status();
    EXPECT_EQ(std::string(auth.status().message()).find("tok1"),
              std::string::npos);
  }
  EXPECT_FALSE(Authenticator::FromFile("/nonexistent/tokens").ok());
}

TEST(TenancyTest, ScopesAndUnscopesModelIds) {
  EXPECT_EQ(ScopedModelId("", "m1"), "m1");
  EXPECT_EQ(ScopedModelId("alice", "m1"), "alice/m1");
  EXPECT_EQ(ClientModelId("alice/m1"), "m1");
  EXPECT_EQ(ClientModelId("m1"), "m1");
  EXPECT_TRUE(InTenant("alice/m1", "alice"));
  EXPECT_FALSE(InTenant("alice/m1", "bob"));
  EXPECT_FALSE(InTenant("alice2/m1", "alice"));
  EXPECT_FALSE(InTenant("m1", "alice"));
  EXPECT_TRUE(InTenant("m1", ""));
  // A scoped id round-trips for every valid client id.
  for (const std::string& id : {std::string("a"), std::string("x.y-z_0"),
                                std::string("..."), std::string(128, 'q')}) {
    ASSERT_TRUE(ValidateModelId(id).ok()) << id;
    EXPECT_EQ(ClientModelId(ScopedModelId("t", id)), id);
  }
  EXPECT_FALSE(ValidateModelId("alice/m1").ok());  // no client can forge one
  // Ids name checkpoint directories.
  EXPECT_FALSE(ValidateModelId(".").ok());
  EXPECT_FALSE(ValidateModelId("..").ok());
}

// With tenants an empty CreateModel id reaches the engine as the scope
// alone, and the engine draws the id inside it.
TEST(TenancyTest, EngineDrawsServerAssignedIdsInsideTheScope) {
  std::unique_ptr<Engine> engine = Engine::CreateSingleRank({}).value();
  ModelSpec spec;
  spec.config = LlamaConfig::EmbeddedDefault();
  spec.model_id = ScopedModelId("alice", "");
  absl::StatusOr<ModelSummary> created = engine->CreateModel(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(InTenant(created->model_id, "alice")) << created->model_id;
  EXPECT_TRUE(ValidateModelId(ClientModelId(created->model_id)).ok());
  spec.model_id = "";
  EXPECT_FALSE(InTenant(engine->CreateModel(spec)->model_id, "alice"));
}

absl::StatusOr<ParsedFlags> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "tally-server");
  return ParseServerFlags(static_cast<int>(args.size()), args.data());
}

TEST(AccessControlFlagsTest, ParseCheckpointAndSecurityFlags) {
  absl::StatusOr<ParsedFlags> flags =
      Parse({"--checkpoint-root", "/data/ckpt", "--checkpoint-dir=/data/auto",
             "--checkpoint-every-steps", "50", "--checkpoint-keep", "4",
             "--resume", "--checkpoint-on-exit", "--tls-cert", "c.pem",
             "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
             "--auth-tokens-file", "tokens", "--allow-insecure-remote"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  const ServerOptions& o = flags->options;
  EXPECT_EQ(o.checkpoint_root, "/data/ckpt");
  EXPECT_EQ(o.checkpoint_dir, "/data/auto");
  EXPECT_EQ(o.checkpoint_every_steps, 50);
  EXPECT_EQ(o.checkpoint_keep, 4);
  EXPECT_TRUE(o.resume);
  EXPECT_TRUE(o.checkpoint_on_exit);
  EXPECT_EQ(o.tls_cert, "c.pem");
  EXPECT_EQ(o.tls_key, "k.pem");
  EXPECT_EQ(o.tls_client_ca, "ca.pem");
  EXPECT_EQ(o.auth_tokens_file, "tokens");
  EXPECT_TRUE(o.allow_insecure_remote);

  const ServerOptions defaults = Parse({})->options;
  EXPECT_EQ(defaults.host, "127.0.0.1");  // loopback unless told otherwise
  EXPECT_FALSE(defaults.resume);
  EXPECT_FALSE(defaults.checkpoint_on_exit);
  EXPECT_FALSE(defaults.allow_insecure_remote);
  EXPECT_EQ(defaults.checkpoint_every_steps, 0);
  EXPECT_FALSE(Parse({"--checkpoint-keep", "0"}).ok());
  EXPECT_FALSE(Parse({"--resume=maybe"}).ok());
  EXPECT_TRUE(Parse({"--checkpoint-on-exit=false"}).ok());
  EXPECT_FALSE(Parse({"--checkpoint-on-exit=1"}).ok());
}

}  // namespace
}  // namespace tally
