// End-to-end artifacts through the API: a tally-server with tenants and a
// checkpoint root; a tenant saves a checkpoint and an export, lists them,
// downloads them (byte-equal to the server's files, checksums verified),
// resumes an interrupted download, loads by handle and deletes; another
// tenant gets NOT_FOUND for all of it, and escaping handles are refused.
// Also: base model names under --models-root, and tallyctl checkpoints.
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/trainer_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/server_process.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

using ::tally::testing::ReadFileBytes;
using ::tally::testing::RunCommand;
using ::tally::testing::ServerProcess;
using ::tally::testing::StartServerOrFail;
using ::testing::HasSubstr;

constexpr char kAliceToken[] = "alice-5d0c2e7a";
constexpr char kBobToken[] = "bob-91b3f4c6";

v1::CreateModelRequest TinyModel(const std::string& model_id) {
  v1::CreateModelRequest request;
  request.set_model_id(model_id);
  *request.mutable_config() = testing::TinyModelConfig();
  request.set_seed(5);
  return request;
}

class ArtifactsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::temp_directory_path() / "tally-artifacts-e2e-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    root_ = dir_ + "/root";
    models_ = dir_ + "/models";
    fs::create_directories(models_);
    std::ofstream(dir_ + "/tokens") << kAliceToken << " alice\n"
                                    << kBobToken << " bob\n";
    server_ = StartServerOrFail(
        {"--auth-tokens-file", dir_ + "/tokens", "--checkpoint-root", root_,
         "--models-root", models_},
        servers_);
    ASSERT_NE(server_, nullptr);
    alice_ = Client(kAliceToken);
    bob_ = Client(kBobToken);
  }
  void TearDown() override {
    testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
    fs::remove_all(dir_);
  }

  std::unique_ptr<TrainerClient> Client(const std::string& token) {
    TrainerClientOptions options;
    options.target = server_->grpc_target();
    options.token = token;
    options.deadline = absl::Seconds(60);
    return std::make_unique<TrainerClient>(options);
  }

  // Alice's model "m" after one step, saved to runs/s1 and exported to
  // exports/e1; the two responses.
  void SaveAndExport(v1::SaveCheckpointResponse* saved,
                     v1::ExportWeightsResponse* exported) {
    ASSERT_TRUE(alice_->CreateModel(TinyModel("m")).ok());
    testing::Train(*alice_, "m", testing::kTinyVocab, 1, 1);
    v1::SaveCheckpointRequest save;
    save.set_model_id("m");
    save.set_path("runs/s1");
    absl::StatusOr<v1::SaveCheckpointResponse> s = alice_->SaveCheckpoint(save);
    ASSERT_TRUE(s.ok()) << s.status();
    *saved = *s;
    v1::ExportWeightsRequest export_request;
    export_request.set_model_id("m");
    export_request.set_path("exports/e1");
    absl::StatusOr<v1::ExportWeightsResponse> e =
        alice_->ExportWeights(export_request);
    ASSERT_TRUE(e.ok()) << e.status();
    *exported = *e;
  }

  // Every file of the manifest in `local` equals the server's copy in
  // `server_dir`.
  void ExpectSameFiles(const ArtifactManifest& manifest,
                       const std::string& local,
                       const std::string& server_dir) {
    ASSERT_GT(manifest.size(), 2);
    for (const v1::ArtifactFile& file : manifest) {
      const std::string ours = ReadFileBytes(local + "/" + file.path());
      EXPECT_EQ(ours.size(), file.size_bytes()) << file.path();
      EXPECT_TRUE(ours == ReadFileBytes(server_dir + "/" + file.path()))
          << file.path();
    }
  }

  std::string dir_, root_, models_;
  std::vector<std::unique_ptr<ServerProcess>> servers_;
  ServerProcess* server_ = nullptr;
  std::unique_ptr<TrainerClient> alice_, bob_;
};

TEST_F(ArtifactsE2eTest, SaveListDownloadResumeLoadDelete) {
  v1::SaveCheckpointResponse saved;
  v1::ExportWeightsResponse exported;
  ASSERT_NO_FATAL_FAILURE(SaveAndExport(&saved, &exported));
  EXPECT_EQ(saved.handle(), "tally://runs/s1");
  EXPECT_EQ(exported.handle(), "tally://exports/e1");

  absl::StatusOr<v1::ListCheckpointsResponse> listed =
      alice_->ListCheckpoints({});
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->artifacts_size(), 2);
  const v1::Artifact& exp = listed->artifacts(0);  // sorted by handle
  const v1::Artifact& state = listed->artifacts(1);
  EXPECT_EQ(exp.handle(), "tally://exports/e1");
  EXPECT_EQ(exp.kind(), v1::ARTIFACT_KIND_EXPORT);
  EXPECT_EQ(state.handle(), "tally://runs/s1");
  EXPECT_EQ(state.kind(), v1::ARTIFACT_KIND_STATE);
  for (const v1::Artifact& a : listed->artifacts()) {
    EXPECT_EQ(a.model_id(), "m");
    EXPECT_EQ(a.step(), 1);
    EXPECT_GT(a.size_bytes(), 0);
    EXPECT_GT(a.created_unix_seconds(), 0);
    EXPECT_EQ(a.expires_unix_seconds(), 0);
  }
  v1::ListCheckpointsRequest of_other;
  of_other.set_model_id("other");
  EXPECT_EQ(alice_->ListCheckpoints(of_other).value().artifacts_size(), 0);

  // Download: byte-equal, checksums verified by the client.
  const std::string server_dir = root_ + "/alice/runs/s1";
  const std::string local = dir_ + "/local";
  absl::StatusOr<ArtifactManifest> manifest =
      alice_->DownloadArtifact(saved.handle(), local);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  ExpectSameFiles(*manifest, local, server_dir);
  EXPECT_FALSE(fs::exists(local + "/.tally-artifact.json"));

  // Interrupted inside model.safetensors: resumed from the bytes held.
  uint64_t before = 0;
  uint64_t half = 0;
  for (const v1::ArtifactFile& file : *manifest) {
    if (file.path() == "model.safetensors") {
      half = file.size_bytes() / 2;
      fs::resize_file(local + "/" + file.path(), half);
      break;
    }
    before += file.size_bytes();
  }
  ASSERT_GT(half, 0);
  std::vector<uint64_t> reported;
  manifest = alice_->DownloadArtifact(
      saved.handle(), local,
      [&](uint64_t done, uint64_t total) { reported.push_back(done); });
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  ASSERT_FALSE(reported.empty());
  EXPECT_EQ(reported.front(), before + half);
  ExpectSameFiles(*manifest, local, server_dir);

  // A handle is what LoadCheckpoint takes.
  v1::LoadCheckpointRequest load;
  load.set_model_id("m");
  load.set_path(saved.handle());
  absl::StatusOr<v1::LoadCheckpointResponse> loaded =
      alice_->LoadCheckpoint(load);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->model().step(), 1);

  v1::DeleteCheckpointRequest del;
  del.set_handle(saved.handle());
  absl::StatusOr<v1::DeleteCheckpointResponse> deleted =
      alice_->DeleteCheckpoint(del);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(deleted->deleted().handle(), saved.handle());
  EXPECT_FALSE(fs::exists(server_dir));
  EXPECT_TRUE(absl::IsNotFound(
      alice_->DownloadArtifact(saved.handle(), dir_ + "/again").status()));
  EXPECT_TRUE(absl::IsNotFound(alice_->DeleteCheckpoint(del).status()));
  EXPECT_EQ(alice_->ListCheckpoints({}).value().artifacts_size(), 1);
}

TEST_F(ArtifactsE2eTest, AnotherTenantFindsNothingAndEscapesAreRefused) {
  v1::SaveCheckpointResponse saved;
  v1::ExportWeightsResponse exported;
  ASSERT_NO_FATAL_FAILURE(SaveAndExport(&saved, &exported));

  EXPECT_EQ(bob_->ListCheckpoints({}).value().artifacts_size(), 0);
  const absl::Status download =
      bob_->DownloadArtifact(saved.handle(), dir_ + "/bob").status();
  EXPECT_TRUE(absl::IsNotFound(download)) << download;
  v1::DeleteCheckpointRequest del;
  del.set_handle(saved.handle());
  const absl::Status deleted = bob_->DeleteCheckpoint(del).status();
  EXPECT_TRUE(absl::IsNotFound(deleted)) << deleted;
  EXPECT_TRUE(fs::exists(root_ + "/alice/runs/s1"));

  for (const std::string handle :
       {"tally://../alice/runs/s1", "tally:///etc", "runs/s1"}) {
    const absl::Status refused =
        bob_->DownloadArtifact(handle, dir_ + "/bob").status();
    EXPECT_TRUE(absl::IsInvalidArgument(refused)) << handle << " " << refused;
    EXPECT_THAT(refused.message(), ::testing::Not(HasSubstr(root_)));
    del.set_handle(handle);
    EXPECT_TRUE(absl::IsInvalidArgument(bob_->DeleteCheckpoint(del).status()))
        << handle;
  }
  // A symlink planted in Bob's root cannot reach Alice's files.
  fs::create_directories(root_ + "/bob");
  fs::create_directory_symlink(root_ + "/alice", root_ + "/bob/link");
  const absl::Status through_link =
      bob_->DownloadArtifact("tally://link/runs/s1", dir_ + "/bob").status();
  EXPECT_TRUE(absl::IsInvalidArgument(through_link)) << through_link;
}

TEST_F(ArtifactsE2eTest, BaseModelNamesResolveUnderTheModelsRoot) {
  v1::SaveCheckpointResponse saved;
  v1::ExportWeightsResponse exported;
  ASSERT_NO_FATAL_FAILURE(SaveAndExport(&saved, &exported));
  // The export, laid out as the HF hub cache stores "Org/Tiny".
  const std::string entry = models_ + "/models--Org--Tiny";
  fs::create_directories(entry + "/snapshots");
  fs::create_directories(entry + "/refs");
  fs::copy(root_ + "/alice/exports/e1", entry + "/snapshots/rev1");
  std::ofstream(entry + "/refs/main") << "rev1";

  absl::StatusOr<v1::ServerInfo> info = alice_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->base_models(), ::testing::ElementsAre("Org/Tiny"));

  v1::CreateModelRequest create;
  create.set_model_id("from-name");
  create.set_init_checkpoint("Org/Tiny");
  absl::StatusOr<v1::ModelInfo> created = alice_->CreateModel(create);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->config().hidden_size(),
            testing::TinyModelConfig().hidden_size());
  // A name that is not in the root is a path under the checkpoint root, as
  // before: confined.
  create.set_model_id("escape");
  create.set_init_checkpoint("../../etc");
  EXPECT_TRUE(absl::IsPermissionDenied(alice_->CreateModel(create).status()));
}

TEST_F(ArtifactsE2eTest, TallyctlListsDownloadsAndDeletes) {
  v1::SaveCheckpointResponse saved;
  v1::ExportWeightsResponse exported;
  ASSERT_NO_FATAL_FAILURE(SaveAndExport(&saved, &exported));
  const char* tallyctl = std::getenv("TALLY_CTL");
  ASSERT_NE(tallyctl, nullptr) << "TALLY_CTL must name tallyctl";
  auto run = [&](const std::string& args) {
    return RunCommand(absl::StrCat("timeout 120 ", tallyctl, " ", args,
                                   " --target ", server_->grpc_target(),
                                   " --token ", kAliceToken));
  };
  auto [code, out] = run("checkpoints list --model m");
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("tally://runs/s1  state  model m  step 1"));
  EXPECT_THAT(out, HasSubstr("tally://exports/e1  export  model m  step 1"));

  std::tie(code, out) = run(absl::StrCat(
      "checkpoints download tally://exports/e1 ", dir_, "/cli --quiet"));
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("checksums verified"));
  EXPECT_TRUE(ReadFileBytes(dir_ + "/cli/model.safetensors") ==
              ReadFileBytes(root_ + "/alice/exports/e1/model.safetensors"));

  std::tie(code, out) = run("checkpoints delete tally://exports/e1");
  EXPECT_EQ(code, 0) << out;
  std::tie(code, out) = run("checkpoints delete tally://exports/e1");
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("NOT_FOUND"));
  std::tie(code, out) = run("checkpoints download tally://runs/s1");
  EXPECT_EQ(code, 2) << out;
  std::tie(code, out) = run("help checkpoints download");
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("tallyctl checkpoints download"));
  EXPECT_THAT(out, HasSubstr("HANDLE DIR"));
}

}  // namespace
}  // namespace tally
