// End-to-end access control: a tally-server with mutual TLS, bearer tokens,
// tenants, a checkpoint root and tenant-owned periodic checkpoints, driven
// over real TLS connections. The
// certificates are made at test time with the openssl CLI (no key is
// committed); without openssl the TLS test is skipped.
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "base/error_reason.h"
#include "client/trainer_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/server_process.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

using ::tally::testing::HttpGet;
using ::tally::testing::MetricValue;
using ::tally::testing::ServerBinaryFromEnv;
using ::tally::testing::ServerProcess;
using ::tally::testing::StartServerOrFail;

constexpr char kAliceToken[] = "alice-3c1f0e8a9b7d";
constexpr char kBobToken[] = "bob-77e2d90a41c5";

v1::CreateModelRequest TinyModel(const std::string& model_id) {
  v1::CreateModelRequest request;
  request.set_model_id(model_id);
  v1::ModelConfig* config = request.mutable_config();
  config->set_vocab_size(32);
  config->set_hidden_size(16);
  config->set_intermediate_size(24);
  config->set_num_hidden_layers(1);
  config->set_num_attention_heads(2);
  return request;
}

v1::GetModelRequest Get(const std::string& model_id) {
  v1::GetModelRequest request;
  request.set_model_id(model_id);
  return request;
}

class AccessE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::temp_directory_path() / "tally-access-e2e-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A CA, a server certificate for localhost / 127.0.0.1 and a client
  // certificate, all signed by the CA, in dir_.
  void MakeCertificates() {
    const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
    const std::string script = absl::StrCat(
        "set -e; cd '", dir_, "'\n",  //
        "openssl req -x509 ", key, " -nodes -keyout ca.key -out ca.pem",
        " -days 1 -subj /CN=tally-test-ca\n",  //
        "openssl req ", key, " -nodes -keyout server.key -out server.csr",
        " -subj /CN=localhost\n",  //
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext\n",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key",
        " -CAcreateserial -out server.pem -days 1 -extfile san.ext\n",  //
        "openssl req ", key, " -nodes -keyout client.key -out client.csr",
        " -subj /CN=tally-client\n",  //
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key",
        " -CAcreateserial -out client.pem -days 1\n");
    std::ofstream(dir_ + "/make_certs.sh") << script;
    ASSERT_EQ(std::system(absl::StrCat("sh '", dir_, "/make_certs.sh' > '",
                                       dir_, "/openssl.log' 2>&1")
                              .c_str()),
              0)
        << testing::ReadFileBytes(dir_ + "/openssl.log");
  }

  // A client over TLS to `server`; with the client certificate unless
  // `with_certificate` is false, sending `token` when not empty.
  TrainerClient Client(const ServerProcess& server, bool with_certificate,
                       const std::string& token, RetryPolicy retry = {}) {
    return TrainerClient(Channel(server, with_certificate, token),
                         absl::Seconds(20), retry);
  }

  // The channel of such a client.
  std::shared_ptr<grpc::Channel> Channel(const ServerProcess& server,
                                         bool with_certificate,
                                         const std::string& token) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = testing::ReadFileBytes(dir_ + "/ca.pem");
    if (with_certificate) {
      ssl.pem_private_key = testing::ReadFileBytes(dir_ + "/client.key");
      ssl.pem_cert_chain = testing::ReadFileBytes(dir_ + "/client.pem");
    }
    std::shared_ptr<grpc::ChannelCredentials> credentials =
        grpc::SslCredentials(ssl);
    if (!token.empty()) {
      credentials = grpc::CompositeChannelCredentials(
          credentials, grpc::AccessTokenCredentials(token));
    }
    return grpc::CreateChannel(absl::StrCat("localhost:", server.grpc_port()),
                               credentials);
  }

  std::string dir_;
  std::vector<std::unique_ptr<ServerProcess>> servers_;
};

// `body` as the serialized request of CreateModel, over `channel`.
grpc::Status SendRawBody(const std::shared_ptr<grpc::Channel>& channel,
                         const std::string& body) {
  grpc::GenericStub stub(channel);
  grpc::Slice slice(body);
  const grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(20));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/tally.v1.Trainer/CreateModel", grpc::StubOptions(),
                 &request, &response,
                 [&done](grpc::Status status) { done.set_value(status); });
  return done.get_future().get();
}

TEST_F(AccessE2eTest, MutualTlsTokensTenantsAndCheckpointRoot) {
  if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "openssl is not installed; it makes the test certificates";
  }
  MakeCertificates();
  std::ofstream(dir_ + "/tokens") << "# test tokens\n"
                                  << kAliceToken << " alice\n"
                                  << kBobToken << " bob\n";
  const std::string root = dir_ + "/root";
  fs::create_directories(root);
  std::ofstream(dir_ + "/metrics-auth") << "prometheus:scrape-secret\n";
  ServerProcess* server = StartServerOrFail(
      {"--tls-cert", dir_ + "/server.pem", "--tls-key", dir_ + "/server.key",
       "--tls-client-ca", dir_ + "/ca.pem", "--auth-tokens-file",
       dir_ + "/tokens", "--checkpoint-root", root, "--metrics-auth-file",
       dir_ + "/metrics-auth"},
      servers_);
  ASSERT_NE(server, nullptr);

  // mTLS: no client certificate, no connection.
  {
    TrainerClient anonymous = Client(*server, false, kAliceToken);
    EXPECT_EQ(anonymous.ListModels({}).status().code(),
              absl::StatusCode::kUnavailable);
  }
  // The clients close before the server stops: idle TLS connections would
  // hold its shutdown for their grace period.
  {
    // Credentials are checked before anything else, the body included: a
    // body that is no request at all is refused UNAUTHENTICATED without a
    // token, and only with one does it reach parsing.
    const std::string garbage(4096, '\xff');
    EXPECT_EQ(SendRawBody(Channel(*server, true, ""), garbage).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    const grpc::Status parsed =
        SendRawBody(Channel(*server, true, kAliceToken), garbage);
    EXPECT_NE(parsed.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_NE(parsed.error_code(), grpc::StatusCode::OK);
    TrainerClient no_token = Client(*server, true, "");
    // Probes need no token: the health service stays open.
    EXPECT_TRUE(no_token.WaitForServing(absl::Seconds(20)).ok());
    EXPECT_EQ(no_token.ListModels({}).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(no_token.CreateModel(TinyModel("m1")).status().code(),
              absl::StatusCode::kUnauthenticated);
    TrainerClient wrong_token = Client(*server, true, "alice-guess");
    EXPECT_EQ(wrong_token.GetModel(Get("m1")).status().code(),
              absl::StatusCode::kUnauthenticated);

    // Tenants: alice's m1 does not exist for bob, who may have his own.
    TrainerClient alice = Client(*server, true, kAliceToken);
    TrainerClient bob = Client(*server, true, kBobToken);
    absl::StatusOr<v1::ModelInfo> created = alice.CreateModel(TinyModel("m1"));
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ(created->model_id(), "m1");
    EXPECT_EQ(bob.GetModel(Get("m1")).status().code(),
              absl::StatusCode::kNotFound);
    v1::DeleteModelRequest delete_m1;
    delete_m1.set_model_id("m1");
    EXPECT_EQ(bob.DeleteModel(delete_m1).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(bob.ListModels({})->models_size(), 0);
    v1::CreateModelRequest bob_m1 = TinyModel("m1");
    bob_m1.mutable_config()->set_hidden_size(8);
    ASSERT_TRUE(bob.CreateModel(bob_m1).ok());
    absl::StatusOr<v1::ListModelsResponse> listed = alice.ListModels({});
    ASSERT_TRUE(listed.ok()) << listed.status();
    ASSERT_EQ(listed->models_size(), 1);
    EXPECT_EQ(listed->models(0).model_id(), "m1");
    EXPECT_EQ(listed->models(0).config().hidden_size(), 16);  // alice's own
    // tallyctl with the same credentials, and without the token.
    const char* tallyctl = std::getenv("TALLY_CTL");
    ASSERT_NE(tallyctl, nullptr) << "TALLY_CTL must name the tallyctl binary";
    const std::string ctl_tls =
        absl::StrCat(tallyctl, " list --target localhost:", server->grpc_port(),
                     " --ca-cert ", dir_, "/ca.pem --client-cert ", dir_,
                     "/client.pem --client-key ", dir_, "/client.key");
    const auto [listed_code, listed_text] =
        testing::RunCommand(absl::StrCat(ctl_tls, " --token ", kAliceToken));
    EXPECT_EQ(listed_code, 0) << listed_text;
    EXPECT_NE(listed_text.find("m1 "), std::string::npos) << listed_text;
    const auto [refused_code, refused_text] =
        testing::RunCommand("env -u TALLY_TOKEN " + ctl_tls);
    EXPECT_EQ(refused_code, 1) << refused_text;
    EXPECT_NE(refused_text.find("UNAUTHENTICATED"), std::string::npos)
        << refused_text;
    EXPECT_EQ(alice.CreateModel(TinyModel("bad/id")).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(alice.CreateModel(TinyModel("..")).status().code(),
              absl::StatusCode::kInvalidArgument);

    // Checkpoint paths stay inside <root>/<tenant>.
    v1::SaveCheckpointRequest save;
    save.set_model_id("m1");
    for (const std::string& escape :
         {std::string("../escape"), std::string("a/../../escape"),
          dir_ + "/elsewhere", root + "/bob/stolen"}) {
      save.set_path(escape);
      EXPECT_EQ(alice.SaveCheckpoint(save).status().code(),
                absl::StatusCode::kPermissionDenied)
          << escape;
    }
    save.set_path("runs/one");
    absl::StatusOr<v1::SaveCheckpointResponse> saved =
        alice.SaveCheckpoint(save);
    ASSERT_TRUE(saved.ok()) << saved.status();
    const std::string alice_dir = fs::canonical(root).string() + "/alice";
    EXPECT_EQ(saved->path(), alice_dir + "/runs/one");
    EXPECT_TRUE(fs::exists(alice_dir + "/runs/one/model.safetensors"));
    // The same relative path names bob's own (absent) directory.
    v1::LoadCheckpointRequest load;
    load.set_model_id("m1");
    load.set_path("runs/one");
    EXPECT_EQ(bob.LoadCheckpoint(load).status().code(),
              absl::StatusCode::kNotFound);
    load.set_path(alice_dir + "/runs/one");
    EXPECT_EQ(bob.LoadCheckpoint(load).status().code(),
              absl::StatusCode::kPermissionDenied);

    // /metrics names the tenants' models: only the scraper may read it.
    for (const std::string& headers :
         {std::string(),
          absl::StrCat("Authorization: Basic ",
                       absl::Base64Escape("prometheus:guess"), "\r\n")}) {
      const absl::StatusOr<std::string> refused =
          HttpGet(server->metrics_port(), "/metrics", headers);
      ASSERT_FALSE(refused.ok()) << *refused;
      EXPECT_NE(refused.status().message().find(" 401 "), std::string::npos)
          << refused.status();
    }
    absl::StatusOr<std::string> metrics = HttpGet(
        server->metrics_port(), "/metrics",
        absl::StrCat("Authorization: Basic ",
                     absl::Base64Escape("prometheus:scrape-secret"), "\r\n"));
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_NE(metrics->find("model_id=\"alice/m1\""), std::string::npos);
    // The series need the scraper's credentials; the probes need none, and
    // answer whatever the gRPC port's transport.
    EXPECT_THAT(
        std::string(
            HttpGet(server->metrics_port(), "/metrics").status().message()),
        ::testing::HasSubstr(" 401 "));
    EXPECT_EQ(HttpGet(server->metrics_port(), "/readyz").value_or("?"), "ok\n");
    EXPECT_EQ(HttpGet(server->metrics_port(), "/healthz").value_or("?"),
              "ok\n");
    // Four calls without a token (the raw body and tallyctl's among them),
    // one with a wrong one (the call without a client certificate never
    // reached the server).
    EXPECT_EQ(MetricValue(*metrics, "tally_auth_failures_total",
                          {{"reason", "missing_token"}})
                  .value_or(-1),
              4);
    EXPECT_EQ(MetricValue(*metrics, "tally_auth_failures_total",
                          {{"reason", "invalid_token"}})
                  .value_or(-1),
              1);
    EXPECT_EQ(MetricValue(*metrics, "tally_checkpoint_seconds_count",
                          {{"kind", "save"}})
                  .value_or(-1),
              1);
    EXPECT_GT(MetricValue(*metrics,
                          "tally_checkpoint_last_success_timestamp_seconds", {})
                  .value_or(-1),
              1.6e9);
  }
  testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
}

// Periodic checkpoints of two tenants' models, kill -9, --resume: each model
// comes back as its tenant's, with the parameters it had, and stays out of
// the other tenant's reach. Bob's model id looks like a step directory, which
// must not turn his tenant directory into a model of its own.
TEST_F(AccessE2eTest, ResumedModelsStayTheirTenants) {
  if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "openssl is not installed; it makes the test certificates";
  }
  MakeCertificates();
  std::ofstream(dir_ + "/tokens") << kAliceToken << " alice\n"
                                  << kBobToken << " bob\n";
  const std::string checkpoints = dir_ + "/checkpoints";
  const std::vector<std::string> flags = {"--tls-cert",
                                          dir_ + "/server.pem",
                                          "--tls-key",
                                          dir_ + "/server.key",
                                          "--auth-tokens-file",
                                          dir_ + "/tokens",
                                          "--checkpoint-dir",
                                          checkpoints,
                                          "--checkpoint-root",
                                          dir_ + "/clients",
                                          "--checkpoint-every-steps",
                                          "2"};
  constexpr int32_t kVocab = 32;  // TinyModel's
  const std::string alice_model = "alpha";
  const std::string bob_model = "step-000000000001";
  std::vector<std::unique_ptr<ServerProcess>> killed;
  ServerProcess* first = StartServerOrFail(flags, killed);
  ASSERT_NE(first, nullptr);
  std::map<std::string, std::string> weights_before;  // by model id
  {
    TrainerClient alice = Client(*first, false, kAliceToken);
    TrainerClient bob = Client(*first, false, kBobToken);
    for (auto [client, id] :
         {std::pair{&alice, alice_model}, std::pair{&bob, bob_model}}) {
      ASSERT_TRUE(client->CreateModel(TinyModel(id)).ok());
      // Different step counts, so that swapped models would show.
      testing::Train(*client, id, kVocab, 1, id == alice_model ? 2 : 4);
      v1::SaveCheckpointRequest save;
      save.set_model_id(id);
      save.set_path("before-" + id);  // in the tenant's folder of the root
      const auto saved = client->SaveCheckpoint(save);
      ASSERT_TRUE(saved.ok()) << saved.status();
      weights_before[id] =
          testing::ReadFileBytes(saved->path() + "/model.safetensors");
      ASSERT_FALSE(weights_before[id].empty());
    }
  }
  EXPECT_TRUE(fs::is_directory(checkpoints + "/alice/alpha/step-000000000002"));
  EXPECT_TRUE(fs::is_directory(checkpoints + "/bob/" + bob_model +
                               "/step-000000000004"));
  ASSERT_EQ(kill(first->pid(), SIGKILL), 0);
  ASSERT_FALSE(first->Stop(absl::Seconds(30)).ok());  // killed by signal 9

  std::vector<std::string> resume = flags;
  resume.push_back("--resume");
  ServerProcess* second = StartServerOrFail(resume, servers_);
  ASSERT_NE(second, nullptr);
  {
    TrainerClient alice = Client(*second, false, kAliceToken);
    TrainerClient bob = Client(*second, false, kBobToken);
    for (auto [owner, other, id, step] :
         {std::tuple{&alice, &bob, alice_model, 2},
          std::tuple{&bob, &alice, bob_model, 4}}) {
      SCOPED_TRACE(id);
      const absl::StatusOr<v1::ModelInfo> info = owner->GetModel(Get(id));
      ASSERT_TRUE(info.ok()) << info.status() << second->ReadLog();
      EXPECT_EQ(info->step(), step);
      EXPECT_EQ(other->GetModel(Get(id)).status().code(),
                absl::StatusCode::kNotFound);
      const absl::StatusOr<v1::ListModelsResponse> listed =
          owner->ListModels({});
      ASSERT_TRUE(listed.ok()) << listed.status();
      ASSERT_EQ(listed->models_size(), 1);
      EXPECT_EQ(listed->models(0).model_id(), id);
      v1::SaveCheckpointRequest save;
      save.set_model_id(id);
      save.set_path("after-" + id);
      const auto saved = owner->SaveCheckpoint(save);
      ASSERT_TRUE(saved.ok()) << saved.status();
      EXPECT_TRUE(weights_before[id] ==
                  testing::ReadFileBytes(saved->path() + "/model.safetensors"))
          << "the resumed parameters differ";
    }
  }
  testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
}

// With tenants, every client checkpoint path is confined to its tenant's
// folder, so a server with tokens and no --checkpoint-root refuses to start
// (before, one tenant could load and overwrite another's checkpoints); and
// the server's own periodic checkpoints may not lie in any tenant's reach
// (before, a tenant named "periodic" reached <root>/periodic).
TEST_F(AccessE2eTest, TenantsNeedAConfinedCheckpointRootApartFromPeriodic) {
  std::ofstream(dir_ + "/tokens") << kAliceToken << " alice\n";
  const std::string tokens = dir_ + "/tokens";
  const std::string root = dir_ + "/root";
  const struct {
    std::vector<std::string> flags;
    std::string refusal;
  } cases[] = {
      {{"--auth-tokens-file", tokens},
       "--auth-tokens-file needs --checkpoint-root"},
      {{"--auth-tokens-file", tokens, "--checkpoint-root", root,
        "--checkpoint-dir", root + "/periodic"},
       "overlap"},
      {{"--checkpoint-root", root + "/x/", "--checkpoint-dir", root},
       "overlap"},
  };
  for (const auto& c : cases) {
    const absl::StatusOr<std::unique_ptr<ServerProcess>> refused =
        ServerProcess::Start(testing::ServerBinaryFromEnv(), c.flags);
    ASSERT_FALSE(refused.ok()) << c.refusal;
    EXPECT_THAT(std::string(refused.status().message()),
                ::testing::HasSubstr(c.refusal));
  }
  // Apart, they start; a missing root is created.
  ServerProcess* server = StartServerOrFail(
      {"--auth-tokens-file", tokens, "--checkpoint-root", root + "/clients",
       "--checkpoint-dir", root + "/periodic"},
      servers_);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(fs::is_directory(root + "/clients"));
}

// A tenant whose sequenced requests wait behind a missing seq_id fills its
// own share of the request budget, not the server's: another tenant is
// still served.
TEST_F(AccessE2eTest, OneTenantCannotTakeTheWholeRequestBudget) {
  if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "openssl is not installed; it makes the test certificates";
  }
  MakeCertificates();
  std::ofstream(dir_ + "/tokens") << kAliceToken << " alice\n"
                                  << kBobToken << " bob\n";
  // The gap never times out during the test: what holds Alice's requests is
  // the missing seq_id 1 alone, and the shutdown at the end answers them.
  ServerProcess* server = StartServerOrFail(
      {"--tls-cert", dir_ + "/server.pem", "--tls-key", dir_ + "/server.key",
       "--auth-tokens-file", dir_ + "/tokens", "--checkpoint-root",
       dir_ + "/root", "--max-queued-requests", "6",
       "--max-queued-requests-per-tenant", "3", "--seq-gap-timeout-secs",
       "600"},
      servers_);
  ASSERT_NE(server, nullptr);
  RetryPolicy once;
  once.max_attempts = 1;
  // Alice's held calls outlast any wait below: only the shutdown ends them.
  TrainerClient alice(Channel(*server, false, kAliceToken), absl::Minutes(5),
                      once);
  TrainerClient bob = Client(*server, false, kBobToken, once);
  ASSERT_TRUE(alice.CreateModel(TinyModel("a")).ok());
  ASSERT_TRUE(bob.CreateModel(TinyModel("b")).ok());
  auto alice_call = [&alice](uint64_t seq_id) {
    v1::ForwardBackwardRequest call;
    call.set_model_id("a");
    call.set_seq_id(seq_id);
    std::mt19937 rng(static_cast<uint32_t>(seq_id));
    *call.add_samples() = testing::MakeSample(rng, 32, 6, 0);
    return alice.ForwardBackward(call).status();
  };
  // Alice sends seq_ids 2..4, her whole budget; seq_id 1 never comes, so
  // they wait.
  std::vector<std::future<absl::Status>> waiting;
  for (uint64_t seq_id = 2; seq_id <= 4; ++seq_id) {
    waiting.push_back(std::async(std::launch::async, alice_call, seq_id));
  }
  // Until all three are held (the server's own count, read without taking
  // a place in the budget).
  double held = 0;
  for (int poll = 0; poll < 1200 && held < 3; ++poll) {
    const absl::StatusOr<std::string> metrics =
        HttpGet(server->metrics_port(), "/metrics");
    if (metrics.ok()) {
      held = MetricValue(*metrics, "tally_queue_depth", {}).value_or(0);
    }
    if (held < 3) absl::SleepFor(absl::Milliseconds(50));
  }
  if (held < 3) {
    for (auto& call : waiting) {
      if (call.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
        ADD_FAILURE() << "a held call ended: " << call.get();
      }
    }
    FAIL() << "the server holds " << held << " of Alice's 3 calls; log:\n"
           << server->ReadLog();
  }
  // Her next request is refused; it would be retryable.
  const absl::Status full = alice.GetModel(Get("a")).status();
  ASSERT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_EQ(ReasonOf(full), ErrorReason::kQueueFull);
  EXPECT_TRUE(IsRetryable(full));
  const absl::Status refused = alice_call(5);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_EQ(ReasonOf(refused), ErrorReason::kQueueFull);
  // Bob is served: the server as a whole still has room.
  const absl::StatusOr<v1::ModelInfo> served = bob.GetModel(Get("b"));
  EXPECT_TRUE(served.ok()) << served.status();
  // A shutdown answers each held request once, as not run and retryable.
  absl::StatusOr<int> exit_code = server->Stop(absl::Seconds(60));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << server->ReadLog();
  for (auto& call : waiting) {
    const absl::Status status = call.get();
    EXPECT_TRUE(absl::IsUnavailable(status)) << status;
    EXPECT_TRUE(IsRetryable(status)) << status;
  }
}

// Tenants on an address others can reach need /metrics protected: its
// series name every tenant's models. The server refuses to start otherwise,
// naming the flag.
TEST_F(AccessE2eTest, TenantsOffLoopbackNeedMetricsCredentials) {
  if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "openssl is not installed; it makes the test certificates";
  }
  MakeCertificates();
  std::ofstream(dir_ + "/tokens") << kAliceToken << " alice\n";
  const std::vector<std::string> tenants = {"--host",
                                            "0.0.0.0",
                                            "--tls-cert",
                                            dir_ + "/server.pem",
                                            "--tls-key",
                                            dir_ + "/server.key",
                                            "--auth-tokens-file",
                                            dir_ + "/tokens",
                                            "--checkpoint-root",
                                            dir_ + "/root"};
  absl::StatusOr<std::unique_ptr<ServerProcess>> refused =
      ServerProcess::Start(ServerBinaryFromEnv(), tenants);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("needs --metrics-auth-file"),
            std::string::npos)
      << refused.status();
  std::ofstream(dir_ + "/half") << "user-without-password\n";
  std::vector<std::string> malformed = tenants;
  malformed.insert(malformed.end(), {"--metrics-auth-file", dir_ + "/half"});
  refused = ServerProcess::Start(ServerBinaryFromEnv(), malformed);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("'<user>:<password>'"),
            std::string::npos)
      << refused.status();
}

TEST_F(AccessE2eTest, PlaintextOnlyOnLoopbackUnlessAllowed) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> refused =
      ServerProcess::Start(ServerBinaryFromEnv(), {"--host", "0.0.0.0"});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("refusing to serve plaintext"),
            std::string::npos)
      << refused.status();

  ServerProcess* allowed = StartServerOrFail(
      {"--host", "0.0.0.0", "--allow-insecure-remote"}, servers_);
  ASSERT_NE(allowed, nullptr);
  {
    TrainerClientOptions options;
    options.target = allowed->grpc_target();
    TrainerClient client(options);
    EXPECT_TRUE(client.ListModels({}).ok());
  }
  testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
}

}  // namespace
}  // namespace tally
