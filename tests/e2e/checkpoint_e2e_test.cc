// End-to-end checkpoint tests with real tally-server processes: periodic
// checkpoints, the exact resume of a server killed with SIGKILL (-9), on one
// rank and on two, checked bitwise against an uninterrupted run, and the
// checkpoint a SIGTERMed server writes with --checkpoint-on-exit.
#include <google/protobuf/util/message_differencer.h>
#include <signal.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/trainer_client.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/server_process.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

using ::google::protobuf::util::MessageDifferencer;
using ::tally::testing::ServerProcess;
using ::tally::testing::StartServerOrFail;

constexpr int32_t kVocab = 48;
// One model per dtype, trained side by side in each server.
const char* const kModelIds[] = {"resumed32", "resumed64"};
constexpr v1::DType kDtypes[] = {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT64};

v1::CreateModelRequest TinyModel(const std::string& model_id, v1::DType dtype) {
  v1::CreateModelRequest request;
  request.set_model_id(model_id);
  v1::ModelConfig* config = request.mutable_config();
  config->set_vocab_size(kVocab);
  config->set_hidden_size(16);
  config->set_intermediate_size(24);
  config->set_num_hidden_layers(2);
  config->set_num_attention_heads(4);
  config->set_num_key_value_heads(2);
  config->set_max_position_embeddings(32);
  request.set_seed(17);
  request.set_dtype(dtype);
  request.set_default_max_grad_norm(0.5);  // clipping active: more state
  request.mutable_default_adam()->set_learning_rate(1e-2);
  return request;
}

std::vector<v1::ForwardBackwardRequest> StepWindow(const std::string& model_id,
                                                   int step) {
  return testing::StepWindow(model_id, step, kVocab);
}

void Train(TrainerClient& client, const std::string& model_id, int first,
           int last, uint64_t* seq_id = nullptr) {
  testing::Train(client, model_id, kVocab, first, last, seq_id);
}

std::unique_ptr<TrainerClient> ClientOf(const ServerProcess& server) {
  TrainerClientOptions options;
  options.target = server.grpc_target();
  return std::make_unique<TrainerClient>(options);
}

// The model as the server reports it.
absl::StatusOr<v1::ModelInfo> Info(TrainerClient& client,
                                   const std::string& model_id) {
  v1::GetModelRequest get;
  get.set_model_id(model_id);
  return client.GetModel(get);
}

class CheckpointE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::temp_directory_path() / "tally-ckpt-e2e-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Saves `model_id` of `client` to `name` and returns the path.
  std::string Save(TrainerClient& client, const std::string& model_id,
                   const std::string& name) {
    v1::SaveCheckpointRequest save;
    save.set_model_id(model_id);
    save.set_path(dir_ + "/" + name);
    absl::StatusOr<v1::SaveCheckpointResponse> saved =
        client.SaveCheckpoint(save);
    EXPECT_TRUE(saved.ok()) << saved.status();
    return save.path();
  }

  // Train 6 steps, versus train 3, kill -9, restart with --resume, train 3,
  // on servers started with `server_flags` (the reference too: another mesh
  // sums in another order): the same parameters and optimizer moments, bit
  // for bit, in FLOAT32 and FLOAT64.
  void ExpectExactResumeAfterKill(
      const std::vector<std::string>& server_flags) {
    ServerProcess* reference = StartServerOrFail(server_flags, servers_);
    ASSERT_NE(reference, nullptr);
    std::unique_ptr<TrainerClient> reference_client = ClientOf(*reference);
    std::vector<std::string> periodic = server_flags;
    periodic.insert(periodic.end(), {"--checkpoint-dir", dir_ + "/periodic",
                                     "--checkpoint-every-steps", "3",
                                     "--checkpoint-keep", "2"});
    ServerProcess* first = StartServerOrFail(periodic, killed_);
    ASSERT_NE(first, nullptr);
    std::unique_ptr<TrainerClient> first_client = ClientOf(*first);
    for (int m = 0; m < 2; ++m) {
      ASSERT_TRUE(
          reference_client->CreateModel(TinyModel(kModelIds[m], kDtypes[m]))
              .ok());
      Train(*reference_client, kModelIds[m], 1, 6);
      ASSERT_TRUE(
          first_client->CreateModel(TinyModel(kModelIds[m], kDtypes[m])).ok());
      Train(*first_client, kModelIds[m], 1, 3);
      // A pending window at the kill: lost, as the checkpoint never held it.
      ASSERT_TRUE(
          first_client->ForwardBackward(StepWindow(kModelIds[m], 99)[0]).ok());
    }
    ServerProcess* second = KillAndResume(*first, periodic);
    ASSERT_NE(second, nullptr);
    std::unique_ptr<TrainerClient> second_client = ClientOf(*second);
    for (int m = 0; m < 2; ++m) {
      const std::string id = kModelIds[m];
      SCOPED_TRACE(id);
      EXPECT_NE(second->ReadLog().find("resumed model '" + id + "' at step 3"),
                std::string::npos)
          << second->ReadLog();
      absl::StatusOr<v1::ModelInfo> info = Info(*second_client, id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->step(), 3);
      EXPECT_EQ(info->accumulated_calls(), 0);
      EXPECT_EQ(info->dtype(), kDtypes[m]);
      Train(*second_client, id, 4, 6);
      const std::string expected =
          Save(*reference_client, id, id + "-reference");
      const std::string actual = Save(*second_client, id, id + "-resumed");
      for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
        const std::string want = testing::ReadFileBytes(expected + "/" + file);
        ASSERT_FALSE(want.empty()) << file;
        EXPECT_TRUE(want == testing::ReadFileBytes(actual + "/" + file))
            << file << " differs";
      }
      // Periodic checkpoints at steps 3 and 6, both kept (--checkpoint-keep
      // 2).
      const std::string model_dir = dir_ + "/periodic/" + id;
      EXPECT_TRUE(fs::is_directory(model_dir + "/step-000000000003"));
      EXPECT_TRUE(fs::is_directory(model_dir + "/step-000000000006"));
    }
    // Idle connections would hold the servers' shutdown.
    reference_client.reset();
    second_client.reset();
    testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
  }

  // The exit checkpoint test on servers started with `server_flags` (the
  // reference too).
  void ExpectExitCheckpointResumesExactly(
      const std::vector<std::string>& server_flags) {
    ServerProcess* reference = StartServerOrFail(server_flags, servers_);
    ASSERT_NE(reference, nullptr);
    std::unique_ptr<TrainerClient> reference_client = ClientOf(*reference);
    const std::string exit_dir = dir_ + "/exit";
    std::vector<std::string> on_exit = server_flags;
    on_exit.insert(on_exit.end(),
                   {"--checkpoint-dir", exit_dir, "--checkpoint-on-exit"});
    ServerProcess* first = StartServerOrFail(on_exit, stopped_);
    ASSERT_NE(first, nullptr);
    std::unique_ptr<TrainerClient> first_client = ClientOf(*first);
    uint64_t seq_ids[2] = {0, 0};
    for (int m = 0; m < 2; ++m) {
      ASSERT_TRUE(
          reference_client->CreateModel(TinyModel(kModelIds[m], kDtypes[m]))
              .ok());
      Train(*reference_client, kModelIds[m], 1, 3);
      ASSERT_TRUE(
          first_client->CreateModel(TinyModel(kModelIds[m], kDtypes[m])).ok());
      Train(*first_client, kModelIds[m], 1, 3, &seq_ids[m]);
      v1::ForwardBackwardRequest pending = StepWindow(kModelIds[m], 4)[0];
      pending.set_seq_id(++seq_ids[m]);
      ASSERT_TRUE(first_client->ForwardBackward(pending).ok());
    }
    first_client.reset();  // an idle connection would hold the shutdown
    const absl::StatusOr<int> exit_code = first->Stop(absl::Seconds(30));
    ASSERT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(*exit_code, 0) << first->ReadLog();
    for (const char* id : kModelIds) {
      EXPECT_NE(
          first->ReadLog().find(absl::StrCat("exit checkpoint of model '", id,
                                             "' drops its pending window (1 "
                                             "calls")),
          std::string::npos)
          << first->ReadLog();
      // The exit checkpoint and nothing else (no periodic ones).
      std::vector<std::string> saved;
      for (const auto& entry : fs::directory_iterator(exit_dir + "/" + id)) {
        saved.push_back(entry.path().filename().string());
      }
      EXPECT_EQ(saved, std::vector<std::string>{"step-000000000003"});
    }

    std::vector<std::string> resume = server_flags;
    resume.insert(resume.end(), {"--checkpoint-dir", exit_dir, "--resume"});
    ServerProcess* second = StartServerOrFail(resume, servers_);
    ASSERT_NE(second, nullptr);
    std::unique_ptr<TrainerClient> client = ClientOf(*second);
    for (int m = 0; m < 2; ++m) {
      const std::string id = kModelIds[m];
      SCOPED_TRACE(id);
      absl::StatusOr<v1::ModelInfo> info = Info(*client, id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->step(), 3);
      EXPECT_EQ(info->dtype(), kDtypes[m]);
      EXPECT_EQ(info->accumulated_calls(), 0);
      EXPECT_EQ(info->next_seq_id(), seq_ids[m] + 1);
      v1::OptimStepRequest optim;
      optim.set_model_id(id);
      optim.set_seq_id(++seq_ids[m]);
      const absl::Status refused = client->OptimStep(optim).status();
      EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << refused;
      EXPECT_NE(
          refused.message().find("the server restarted from a checkpoint"),
          std::string::npos)
          << refused;
      v1::AbortAccumulationRequest abort;
      abort.set_model_id(id);
      abort.set_seq_id(++seq_ids[m]);
      ASSERT_TRUE(client->AbortAccumulation(abort).ok());
      const std::string expected =
          Save(*reference_client, id, id + "-reference");
      const std::string actual = Save(*client, id, id + "-resumed");
      for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
        const std::string want = testing::ReadFileBytes(expected + "/" + file);
        ASSERT_FALSE(want.empty()) << file;
        EXPECT_TRUE(want == testing::ReadFileBytes(actual + "/" + file))
            << file << " differs";
      }
      Train(*client, id, 4, 4, &seq_ids[m]);  // the resent window steps
    }
    reference_client.reset();
    client.reset();
    testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
  }

  // Kills `first` and starts a server with `flags` + --resume on its
  // checkpoints; null (and a test failure) if it does not start.
  ServerProcess* KillAndResume(ServerProcess& first,
                               std::vector<std::string> flags) {
    Kill(first);
    flags.push_back("--resume");
    return StartServerOrFail(flags, servers_);
  }

  // SIGKILL: no shutdown, no final write, like a crashed node.
  static void Kill(ServerProcess& server) {
    ASSERT_EQ(kill(server.pid(), SIGKILL), 0);
    const absl::StatusOr<int> outcome = server.Stop(absl::Seconds(30));
    ASSERT_FALSE(outcome.ok());
    EXPECT_NE(outcome.status().message().find("killed by signal 9"),
              std::string::npos)
        << outcome.status();
  }

  std::string dir_;
  std::vector<std::unique_ptr<ServerProcess>> servers_;  // stopped cleanly
  std::vector<std::unique_ptr<ServerProcess>> killed_;
  std::vector<std::unique_ptr<ServerProcess>> stopped_;  // by the test
};

// Train 6 steps, versus train 3, kill -9, restart with --resume, train 3:
// the same parameters and optimizer moments, bit for bit, in FLOAT32 and
// FLOAT64.
TEST_F(CheckpointE2eTest, ResumeAfterKillIsExact) {
  ExpectExactResumeAfterKill({});
}

// The same on a 2-rank server whose parameters and optimizer state are
// sharded (ZeRO-3): the ranks save whole tensors and reload their shards.
TEST_F(CheckpointE2eTest, MultiRankResumeAfterKillIsExact) {
  ExpectExactResumeAfterKill({"--nproc-per-node", "2", "--dp-shard", "2"});
}

// The same under ZeRO-1: the resumed ranks gather their parameters again
// and keep whole gradients, and continue bit for bit.
TEST_F(CheckpointE2eTest, ZeroStage1ResumeAfterKillIsExact) {
  ExpectExactResumeAfterKill(
      {"--nproc-per-node", "2", "--dp-shard", "2", "--zero-stage", "1"});
}

// Two LoRA adapters of different ranks over one base, checkpointed (the
// adapters only), killed and resumed: they come back over one shared base
// and continue bit for bit as adapters trained without the restart.
TEST_F(CheckpointE2eTest, LoraAdaptersResumeOverTheirSharedBaseExactly) {
  ServerProcess* reference = StartServerOrFail({}, servers_);
  ASSERT_NE(reference, nullptr);
  std::unique_ptr<TrainerClient> reference_client = ClientOf(*reference);
  const std::vector<std::string> flags = {
      "--checkpoint-dir", dir_ + "/periodic", "--checkpoint-every-steps", "2"};
  ServerProcess* first = StartServerOrFail(flags, killed_);
  ASSERT_NE(first, nullptr);
  std::unique_ptr<TrainerClient> first_client = ClientOf(*first);
  const std::pair<const char*, int> adapters[] = {{"lora-a", 2}, {"lora-b", 4}};
  uint64_t seq_ids[2] = {0, 0};
  for (int m = 0; m < 2; ++m) {
    v1::CreateModelRequest create =
        TinyModel(adapters[m].first, v1::DTYPE_FLOAT64);
    create.mutable_lora()->set_rank(adapters[m].second);
    create.mutable_lora()->set_alpha(8);
    ASSERT_TRUE(reference_client->CreateModel(create).ok());
    Train(*reference_client, adapters[m].first, 1, 4);
    ASSERT_TRUE(first_client->CreateModel(create).ok());
    Train(*first_client, adapters[m].first, 1, 2, &seq_ids[m]);
  }
  first_client.reset();
  ServerProcess* second = KillAndResume(*first, flags);
  ASSERT_NE(second, nullptr);
  std::unique_ptr<TrainerClient> client = ClientOf(*second);
  std::string base;
  for (int m = 0; m < 2; ++m) {
    const std::string id = adapters[m].first;
    SCOPED_TRACE(id);
    absl::StatusOr<v1::ModelInfo> info = Info(*client, id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->step(), 2);
    EXPECT_EQ(info->lora().rank(), adapters[m].second);
    EXPECT_EQ(info->lora().alpha(), 8);
    if (m == 1) EXPECT_EQ(info->base(), base);
    base = info->base();
    Train(*client, id, 3, 4, &seq_ids[m]);
    const std::string expected = Save(*reference_client, id, id + "-ref");
    const std::string actual = Save(*client, id, id + "-resumed");
    for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
      const std::string want = testing::ReadFileBytes(expected + "/" + file);
      ASSERT_FALSE(want.empty()) << file;
      EXPECT_TRUE(want == testing::ReadFileBytes(actual + "/" + file))
          << file << " differs";
    }
  }
  reference_client.reset();
  client.reset();
  testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
}

// --checkpoint-on-exit without periodic checkpoints: SIGTERM saves every
// model at its step and exits 0; --resume brings back exactly those
// parameters and optimizer moments, and the seq_ids. The window pending at
// the exit (its gradients dropped) comes back poisoned, so the client's
// OptimStep does not step on what is left of it.
TEST_F(CheckpointE2eTest, SigtermWritesAnExitCheckpointThatResumesExactly) {
  ExpectExitCheckpointResumesExactly({});
}

// The same on 2 ranks: the exit save is replicated, and the ranks > 0,
// still in their command loop, take part (their shards are gathered).
TEST_F(CheckpointE2eTest, MultiRankExitCheckpointResumesExactly) {
  ExpectExitCheckpointResumesExactly(
      {"--nproc-per-node", "2", "--dp-shard", "2"});
}

// A server asked for an exit checkpoint without a place for it refuses to
// start, naming the flag, with a command-line error's exit status.
TEST_F(CheckpointE2eTest, CheckpointOnExitNeedsACheckpointDir) {
  const absl::StatusOr<std::unique_ptr<ServerProcess>> refused =
      ServerProcess::Start(testing::ServerBinaryFromEnv(),
                           {"--checkpoint-on-exit"});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("exit code 2"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find(
                "--checkpoint-on-exit needs --checkpoint-dir"),
            std::string::npos)
      << refused.status();
}

// Sequenced training, kill -9, --resume: the model's seq_ids continue where
// its periodic checkpoint left them, and retries of seq_ids before it replay
// the cached outcome; an unsequenced LoadCheckpoint brings them back too.
TEST_F(CheckpointE2eTest, ResumeContinuesTheSeqIds) {
  const std::string id = "sequenced";
  const std::vector<std::string> periodic = {
      "--checkpoint-dir", dir_ + "/periodic", "--checkpoint-every-steps", "2"};
  ServerProcess* first = StartServerOrFail(periodic, killed_);
  ASSERT_NE(first, nullptr);
  std::unique_ptr<TrainerClient> first_client = ClientOf(*first);
  ASSERT_TRUE(first_client->CreateModel(TinyModel(id, kDtypes[0])).ok());
  // Steps 1 and 2 as seq_ids 1..6 (two calls and an OptimStep each); the
  // OptimStep with seq_id 6 triggers the checkpoint.
  uint64_t seq_id = 0;
  v1::ForwardBackwardRequest last_call;
  v1::ForwardBackwardResponse last_response;
  v1::OptimStepRequest last_optim;
  for (int step = 1; step <= 2; ++step) {
    for (v1::ForwardBackwardRequest call : StepWindow(id, step)) {
      call.set_seq_id(++seq_id);
      absl::StatusOr<v1::ForwardBackwardResponse> done =
          first_client->ForwardBackward(call);
      ASSERT_TRUE(done.ok()) << done.status();
      last_call = call;
      last_response = *done;
    }
    last_optim.set_model_id(id);
    last_optim.set_seq_id(++seq_id);
    ASSERT_TRUE(first_client->OptimStep(last_optim).ok());
  }
  ASSERT_EQ(seq_id, 6u);
  // Executed after the checkpoint: lost with the kill.
  v1::ForwardBackwardRequest lost = StepWindow(id, 3)[0];
  lost.set_seq_id(7);
  ASSERT_TRUE(first_client->ForwardBackward(lost).ok());
  first_client.reset();
  ServerProcess* second = KillAndResume(*first, periodic);
  ASSERT_NE(second, nullptr);
  std::unique_ptr<TrainerClient> client = ClientOf(*second);
  absl::StatusOr<v1::ModelInfo> info = Info(*client, id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step(), 2);
  EXPECT_EQ(info->next_seq_id(), 7u);
  // seq_id 5 replays its original response and adds nothing to the window.
  absl::StatusOr<v1::ForwardBackwardResponse> replayed =
      client->ForwardBackward(last_call);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*replayed, last_response))
      << replayed->DebugString();
  // seq_id 6 was executing when the checkpoint was taken: used, not cached.
  EXPECT_EQ(client->OptimStep(last_optim).status().code(),
            absl::StatusCode::kAlreadyExists);
  info = Info(*client, id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->accumulated_calls(), 0);
  EXPECT_EQ(info->step(), 2);

  // Step 3 as seq_ids 7..9, then an unsequenced load of the step-2
  // checkpoint goes back to seq_id 7.
  for (v1::ForwardBackwardRequest call : StepWindow(id, 3)) {
    call.set_seq_id(++seq_id);
    ASSERT_TRUE(client->ForwardBackward(call).ok());
  }
  last_optim.set_seq_id(++seq_id);
  absl::StatusOr<v1::OptimStepResponse> stepped = client->OptimStep(last_optim);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->step(), 3);
  v1::LoadCheckpointRequest load;
  load.set_model_id(id);
  load.set_path(dir_ + "/periodic/" + id + "/step-000000000002");
  absl::StatusOr<v1::LoadCheckpointResponse> loaded =
      client->LoadCheckpoint(load);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->model().step(), 2);
  EXPECT_EQ(loaded->model().next_seq_id(), 7u);
  client.reset();
  testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
}

// A checkpoint saved with allow_pending drops the pending calls, yet its
// sequencing state counts them as executed. An unsequenced load that takes
// over those seq_ids therefore poisons the window: the client resuming at
// next_seq_id gets ABORTED at its OptimStep instead of a step on a window
// missing the dropped calls.
// A deleted model's periodic checkpoints go with it: --resume brings back
// the models that exist, not the deleted ones.
TEST_F(CheckpointE2eTest, ResumeDoesNotResurrectADeletedModel) {
  const std::vector<std::string> periodic = {
      "--checkpoint-dir", dir_ + "/periodic", "--checkpoint-every-steps", "1"};
  ServerProcess* first = StartServerOrFail(periodic, killed_);
  ASSERT_NE(first, nullptr);
  {
    std::unique_ptr<TrainerClient> client = ClientOf(*first);
    for (const char* id : {"kept", "gone"}) {
      ASSERT_TRUE(client->CreateModel(TinyModel(id, kDtypes[0])).ok());
      Train(*client, id, 1, 1);
    }
    ASSERT_TRUE(fs::is_directory(dir_ + "/periodic/gone"));
    v1::DeleteModelRequest remove;
    remove.set_model_id("gone");
    ASSERT_TRUE(client->DeleteModel(remove).ok());
    EXPECT_FALSE(fs::exists(dir_ + "/periodic/gone"));
  }
  ServerProcess* second = KillAndResume(*first, periodic);
  ASSERT_NE(second, nullptr);
  std::unique_ptr<TrainerClient> client = ClientOf(*second);
  const absl::StatusOr<v1::ModelInfo> kept = Info(*client, "kept");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->step(), 1);
  EXPECT_EQ(Info(*client, "gone").status().code(), absl::StatusCode::kNotFound);
}

// One model whose checkpoint cannot be restored (here its step directory
// lost tally.json and its checksums: FAILED_PRECONDITION, not a damaged
// file) no longer stops
// the server from starting: the other model resumes, ListModels reports the
// failed one with why, GetModel's NOT_FOUND says so, and creating the id
// again clears the report. Before, the whole server refused to start.
TEST_F(CheckpointE2eTest, AModelThatCannotResumeDoesNotStopTheOthers) {
  const std::vector<std::string> periodic = {
      "--checkpoint-dir", dir_ + "/periodic", "--checkpoint-every-steps", "1"};
  ServerProcess* first = StartServerOrFail(periodic, killed_);
  ASSERT_NE(first, nullptr);
  {
    std::unique_ptr<TrainerClient> client = ClientOf(*first);
    for (const char* id : {"broken", "kept"}) {
      ASSERT_TRUE(client->CreateModel(TinyModel(id, kDtypes[0])).ok());
      Train(*client, id, 1, 2);
    }
  }
  // A plain HF directory now, not a tally checkpoint: refused, not damaged.
  const std::string step = dir_ + "/periodic/broken/step-000000000002";
  ASSERT_TRUE(fs::remove(step + "/tally.json"));
  ASSERT_TRUE(fs::remove(step + "/checksums.sha256"));
  ServerProcess* second = KillAndResume(*first, periodic);
  ASSERT_NE(second, nullptr) << "one model's failure stopped the server";
  std::unique_ptr<TrainerClient> client = ClientOf(*second);
  const absl::StatusOr<v1::ModelInfo> kept = Info(*client, "kept");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->step(), 2);

  const absl::Status broken = Info(*client, "broken").status();
  EXPECT_EQ(broken.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(broken.message().find("could not restore it from "
                                  "step-000000000002"),
            absl::string_view::npos)
      << broken;
  const absl::StatusOr<v1::ListModelsResponse> listed =
      client->ListModels(v1::ListModelsRequest());
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->models_size(), 1);
  EXPECT_EQ(listed->models(0).model_id(), "kept");
  ASSERT_EQ(listed->unresumed_size(), 1);
  EXPECT_EQ(listed->unresumed(0).model_id(), "broken");
  EXPECT_EQ(listed->unresumed(0).checkpoint(), "step-000000000002");
  EXPECT_NE(listed->unresumed(0).error().find("FAILED_PRECONDITION"),
            std::string::npos)
      << listed->unresumed(0).error();
  EXPECT_NE(second->ReadLog().find("model 'broken' not resumed"),
            std::string::npos);

  ASSERT_TRUE(client->CreateModel(TinyModel("broken", kDtypes[0])).ok());
  const absl::StatusOr<v1::ListModelsResponse> after =
      client->ListModels(v1::ListModelsRequest());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->models_size(), 2);
  EXPECT_EQ(after->unresumed_size(), 0);
  client.reset();  // an idle connection would hold the shutdown
  testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
}

// A LoadCheckpoint that sets a model back (step 3 to step 1) starts a new
// branch: its periodic checkpoints of later steps are set aside, so the new
// branch's saves are not pruned in their favour and --resume continues the
// new branch. Before, --resume restored the abandoned step 3.
TEST_F(CheckpointE2eTest, ARewoundModelResumesOnItsNewBranch) {
  const std::vector<std::string> periodic = {
      "--checkpoint-dir",         dir_ + "/periodic",
      "--checkpoint-every-steps", "1",
      "--checkpoint-keep",        "2"};
  ServerProcess* first = StartServerOrFail(periodic, killed_);
  ASSERT_NE(first, nullptr);
  std::string new_branch;
  {
    std::unique_ptr<TrainerClient> client = ClientOf(*first);
    ASSERT_TRUE(client->CreateModel(TinyModel("m", kDtypes[0])).ok());
    Train(*client, "m", 1, 1);
    const std::string at_step1 = Save(*client, "m", "at-step1");
    Train(*client, "m", 2, 3);
    v1::LoadCheckpointRequest load;
    load.set_model_id("m");
    load.set_path(at_step1);
    load.set_load_optimizer(true);
    ASSERT_TRUE(client->LoadCheckpoint(load).ok());
    Train(*client, "m", 2, 2);  // the new branch: step 2 again
    new_branch = testing::ReadFileBytes(Save(*client, "m", "new-branch") +
                                        "/model.safetensors");
  }
  EXPECT_TRUE(fs::is_directory(dir_ + "/periodic/m/abandoned"));
  ServerProcess* second = KillAndResume(*first, periodic);
  ASSERT_NE(second, nullptr);
  std::unique_ptr<TrainerClient> client = ClientOf(*second);
  const absl::StatusOr<v1::ModelInfo> resumed = Info(*client, "m");
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->step(), 2);
  EXPECT_TRUE(testing::ReadFileBytes(Save(*client, "m", "resumed") +
                                     "/model.safetensors") == new_branch)
      << "--resume did not continue the new branch";
}

TEST_F(CheckpointE2eTest, LoadOfAPendingSavePoisonsTheContinuedWindow) {
  ServerProcess* server = StartServerOrFail({}, servers_);
  ASSERT_NE(server, nullptr);
  std::unique_ptr<TrainerClient> client = ClientOf(*server);
  const std::string id = "pending";
  ASSERT_TRUE(client->CreateModel(TinyModel(id, kDtypes[1])).ok());
  uint64_t seq_id = 0;
  const std::vector<v1::ForwardBackwardRequest> window = StepWindow(id, 1);
  for (v1::ForwardBackwardRequest call : window) {
    call.set_seq_id(++seq_id);
    ASSERT_TRUE(client->ForwardBackward(call).ok());
  }
  v1::SaveCheckpointRequest save;
  save.set_model_id(id);
  save.set_path(dir_ + "/pending");
  save.set_allow_pending(true);
  save.set_seq_id(++seq_id);
  absl::StatusOr<v1::SaveCheckpointResponse> saved =
      client->SaveCheckpoint(save);
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_EQ(saved->unsaved_calls(), static_cast<int64_t>(window.size()));

  v1::LoadCheckpointRequest load;
  load.set_model_id(id);
  load.set_path(save.path());
  absl::StatusOr<v1::LoadCheckpointResponse> loaded =
      client->LoadCheckpoint(load);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->model().next_seq_id(), seq_id + 1);
  // The client goes on at next_seq_id: one more call, then the step.
  v1::ForwardBackwardRequest more = StepWindow(id, 2)[0];
  more.set_seq_id(++seq_id);
  ASSERT_TRUE(client->ForwardBackward(more).ok());
  v1::OptimStepRequest optim;
  optim.set_model_id(id);
  optim.set_seq_id(++seq_id);
  const absl::Status refused = client->OptimStep(optim).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << refused;
  EXPECT_NE(refused.message().find(absl::StrCat(
                "dropped ", window.size(), " pending ForwardBackward calls")),
            std::string::npos)
      << refused;
  // tally_poisoned_windows_total counts failed calls and sequence gaps, not
  // a window its checkpoint dropped.
  const absl::StatusOr<std::string> metrics =
      testing::HttpGet(server->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(testing::MetricValue(*metrics, "tally_poisoned_windows_total",
                                 {{"model_id", id}})
                .value_or(-1),
            0);
  absl::StatusOr<v1::ModelInfo> info = Info(*client, id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step(), 0);
  v1::AbortAccumulationRequest abort;
  abort.set_model_id(id);
  abort.set_seq_id(++seq_id);
  ASSERT_TRUE(client->AbortAccumulation(abort).ok());
  client.reset();
  testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
}

// A damaged newest checkpoint is skipped: the server resumes from the one
// before it, and keeps only --checkpoint-keep of them.
TEST_F(CheckpointE2eTest, ResumeSkipsADamagedNewestCheckpoint) {
  const std::vector<std::string> periodic = {"--checkpoint-dir",         dir_,
                                             "--checkpoint-every-steps", "1",
                                             "--checkpoint-keep",        "2"};
  ServerProcess* first = StartServerOrFail(periodic, killed_);
  ASSERT_NE(first, nullptr);
  std::unique_ptr<TrainerClient> first_client = ClientOf(*first);
  const std::string id = kModelIds[0];
  ASSERT_TRUE(first_client->CreateModel(TinyModel(id, kDtypes[0])).ok());
  Train(*first_client, id, 1, 3);
  Kill(*first);
  const std::string model_dir = dir_ + "/" + id;
  EXPECT_FALSE(fs::exists(model_dir + "/step-000000000001"));  // pruned
  const std::string newest = model_dir + "/step-000000000003/model.safetensors";
  std::string weights = testing::ReadFileBytes(newest);
  ASSERT_FALSE(weights.empty());
  weights[weights.size() / 2] ^= 0x10;
  std::ofstream(newest, std::ios::binary | std::ios::trunc) << weights;

  std::vector<std::string> resume = periodic;
  resume.push_back("--resume");
  ServerProcess* second = StartServerOrFail(resume, servers_);
  ASSERT_NE(second, nullptr);
  EXPECT_NE(second->ReadLog().find("skipping damaged checkpoint"),
            std::string::npos);
  std::unique_ptr<TrainerClient> second_client = ClientOf(*second);
  absl::StatusOr<v1::ModelInfo> info = Info(*second_client, id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step(), 2);
  second_client.reset();  // an idle connection would hold the shutdown
  testing::ExpectCleanShutdown(servers_, absl::Seconds(30));
}

}  // namespace
}  // namespace tally
