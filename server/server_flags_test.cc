// tally-server's flag parsing and the proto-level request validation.
#include <gtest/gtest.h>

#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "server/convert.h"
#include "server/flags.h"

namespace tally {
namespace {

absl::StatusOr<ParsedFlags> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "tally-server");
  return ParseServerFlags(static_cast<int>(args.size()), args.data());
}

TEST(ServerFlagsTest, ParsesKebabCaseInBothForms) {
  auto flags = Parse({"--grpc-port", "0", "--metrics-port=9191",
                      "--max-message-bytes", "65536", "--demo-model",
                      "--log-level=debug", "--port-file", "/tmp/p.json"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->options.grpc_port, 0);
  EXPECT_EQ(flags->options.metrics_port, 9191);
  EXPECT_EQ(flags->options.max_message_bytes, 65536);
  EXPECT_TRUE(flags->options.demo_model);
  EXPECT_EQ(flags->options.log_level, "debug");
  EXPECT_EQ(flags->options.port_file, "/tmp/p.json");
  EXPECT_FALSE(flags->help);
  EXPECT_FALSE(Parse({"--demo-model=false"})->options.demo_model);
  EXPECT_TRUE(Parse({})->options.overlap_grad_sync);
  EXPECT_FALSE(Parse({"--overlap-grad-sync=false"})->options.overlap_grad_sync);
}

TEST(ServerFlagsTest, MeshAndRankFlags) {
  auto flags =
      Parse({"--nproc-per-node", "16", "--dp-replicate=2", "--dp-shard", "2",
             "--cp=2", "--ep=4", "--tp", "2", "--rank", "3", "--world-size",
             "16", "--master-addr", "tally-0.tally", "--master-port", "29400",
             "--rendezvous-timeout-secs", "60"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  const ServerOptions& o = flags->options;
  EXPECT_EQ(o.nproc_per_node, 16);
  EXPECT_EQ(o.mesh.world_size(), 16);
  EXPECT_EQ(o.mesh.dp_replicate, 2);
  EXPECT_EQ(o.mesh.dp_shard, 2);
  EXPECT_EQ(o.mesh.cp, 2);
  EXPECT_EQ(o.mesh.tp, 2);
  EXPECT_EQ(o.mesh.ep, 4);
  EXPECT_EQ(o.rank_env.rank, 3);
  EXPECT_EQ(o.rank_env.world_size, 16);
  EXPECT_EQ(o.rank_env.master_addr, "tally-0.tally");
  EXPECT_EQ(o.rank_env.master_port, 29400);
  EXPECT_EQ(o.rendezvous_timeout_secs, 60);
  // Unset overrides leave the environment in charge.
  EXPECT_FALSE(Parse({})->options.rank_env.rank.has_value());
  EXPECT_FALSE(Parse({"--tp", "0"}).ok());

  auto pp = Parse({"--pp", "4", "--pp-microbatches", "8"});
  ASSERT_TRUE(pp.ok()) << pp.status();
  EXPECT_EQ(pp->options.mesh.pp, 4);
  EXPECT_EQ(pp->options.mesh.world_size(), 4);
  EXPECT_EQ(pp->options.pp_microbatches, 8);
  EXPECT_EQ(Parse({})->options.pp_microbatches, 0);  // = --pp
  EXPECT_FALSE(Parse({"--pp-microbatches", "0"}).ok());
  EXPECT_FALSE(Parse({"--pp", "0"}).ok());
}

TEST(ServerFlagsTest, VersionIsAFlagOfItsOwn) {
  auto flags = Parse({"--version"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_TRUE(flags->version);
  EXPECT_FALSE(flags->help);
  EXPECT_FALSE(Parse({})->version);
  EXPECT_NE(ServerUsage().find("--version"), std::string::npos);
}

TEST(ServerFlagsTest, DefaultsAndHelp) {
  auto flags = Parse({"--help"});
  ASSERT_TRUE(flags.ok());
  EXPECT_TRUE(flags->help);
  EXPECT_EQ(flags->options.grpc_port, 50051);
  EXPECT_EQ(flags->options.max_message_bytes, int64_t{256} << 20);
  const std::string usage = ServerUsage();
  for (const char* flag :
       {"--grpc-port", "--metrics-port", "--max-message-bytes", "--log-level",
        "--demo-model"}) {
    EXPECT_NE(usage.find(flag), std::string::npos) << flag;
  }
}

TEST(ServerFlagsTest, ReliabilityFlags) {
  auto flags =
      Parse({"--seq-gap-timeout-secs", "2.5", "--seq-cache=8",
             "--max-queued-requests", "9", "--max-queued-requests-per-model",
             "3", "--shutdown-drain-secs", "0.5", "--exit-timeout-secs", "7",
             "--collective-timeout-secs", "45"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  const ServerOptions& o = flags->options;
  EXPECT_EQ(o.seq_gap_timeout_secs, 2.5);
  EXPECT_EQ(o.seq_cache, 8);
  EXPECT_EQ(o.max_queued_requests, 9);
  EXPECT_EQ(o.max_queued_requests_per_model, 3);
  EXPECT_EQ(o.shutdown_drain_secs, 0.5);
  EXPECT_EQ(o.exit_timeout_secs, 7);
  EXPECT_EQ(o.collective_timeout_secs, 45);
  for (const char* bad :
       {"--seq-gap-timeout-secs=0", "--seq-cache=0", "--exit-timeout-secs=-1",
        "--shutdown-drain-secs=x", "--collective-timeout-secs=nan"}) {
    const auto refused = Parse({bad});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(ServerFlagsTest, BucketSizeReachesTheEngineOptions) {
  EXPECT_EQ(Parse({})->options.bucket_mb, EngineOptions().bucket_mb);
  auto flags = Parse({"--bucket-mb", "8"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->options.bucket_mb, 8);
  EXPECT_FALSE(Parse({"--bucket-mb", "0"}).ok());
}

TEST(ServerFlagsTest, ZeroStageReachesTheEngineOptions) {
  EXPECT_EQ(Parse({})->options.zero_stage, ZeroStage::kParameters);
  EXPECT_EQ(Parse({})->options.zero_stage, EngineOptions().zero_stage);
  for (const auto& [arg, stage] :
       std::vector<std::pair<const char*, ZeroStage>>{
           {"--zero-stage=1", ZeroStage::kOptimizerState},
           {"--zero-stage=2", ZeroStage::kGradients},
           {"--zero-stage=3", ZeroStage::kParameters}}) {
    auto flags = Parse({arg});
    ASSERT_TRUE(flags.ok()) << flags.status();
    EXPECT_EQ(flags->options.zero_stage, stage) << arg;
  }
  for (const char* bad :
       {"--zero-stage=0", "--zero-stage=4", "--zero-stage=x"}) {
    const auto refused = Parse({bad});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
    EXPECT_NE(refused.status().message().find("--zero-stage"),
              std::string::npos)
        << refused.status();
  }
  EXPECT_NE(ServerUsage().find("--zero-stage"), std::string::npos);
}

TEST(ServerFlagsTest, DeviceAndTf32) {
  EXPECT_EQ(Parse({})->options.device, DeviceKind::kAuto);
  EXPECT_FALSE(Parse({})->options.allow_tf32);
  auto flags = Parse({"--device=cuda", "--allow-tf32"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->options.device, DeviceKind::kCuda);
  EXPECT_TRUE(flags->options.allow_tf32);
  EXPECT_EQ(Parse({"--device", "cpu"})->options.device, DeviceKind::kCpu);
  const auto refused = Parse({"--device=gpu"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("--device"), std::string::npos)
      << refused.status();
}

TEST(ServerFlagsTest, BadFlagsAreNamed) {
  struct Case {
    std::vector<const char*> args;
    const char* named;
  };
  for (const Case& c :
       std::vector<Case>{{{"--grpc-port", "70000"}, "--grpc-port"},
                         {{"--grpc-port", "abc"}, "--grpc-port"},
                         {{"--log-level", "loud"}, "--log-level"},
                         {{"--log-format", "yaml"}, "--log-format"},
                         {{"--max-message-bytes", "10"}, "--max-message-bytes"},
                         {{"--metrics-port"}, "--metrics-port"},
                         {{"--models-root", "/no/such/dir"}, "--models-root"},
                         {{"--no-such-flag"}, "--no-such-flag"},
                         {{"positional"}, "positional"}}) {
    auto flags = Parse(c.args);
    ASSERT_FALSE(flags.ok()) << c.named;
    EXPECT_EQ(flags.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(flags.status().message().find(c.named), std::string::npos)
        << flags.status();
  }
}

TEST(ServerFlagsTest, ModelsRootReachesTheServerOptions) {
  EXPECT_EQ(Parse({})->options.models_root, "");
  auto flags = Parse({"--models-root", "/tmp"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->options.models_root, "/tmp");
}

TEST(ServerFlagsTest, EachParseStartsFromTheDefaults) {
  auto set = Parse({"--grpc-port", "1", "--demo-model", "--rank", "2",
                    "--master-addr", "h", "--pp-microbatches", "3",
                    "--seq-gap-timeout-secs", "2.5", "--log-level=error"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_FALSE(Parse({"--metrics-port=2", "--no-such-flag"}).ok());
  auto flags = Parse({});
  ASSERT_TRUE(flags.ok()) << flags.status();
  const ServerOptions defaults;
  const ServerOptions& o = flags->options;
  EXPECT_EQ(o.grpc_port, defaults.grpc_port);
  EXPECT_EQ(o.metrics_port, defaults.metrics_port);
  EXPECT_EQ(o.demo_model, defaults.demo_model);
  EXPECT_FALSE(o.rank_env.rank.has_value());
  EXPECT_FALSE(o.rank_env.master_addr.has_value());
  EXPECT_EQ(o.pp_microbatches, defaults.pp_microbatches);
  EXPECT_EQ(o.seq_gap_timeout_secs, defaults.seq_gap_timeout_secs);
  EXPECT_EQ(o.collective_timeout_secs, defaults.collective_timeout_secs);
  EXPECT_EQ(o.rendezvous_timeout_secs, defaults.rendezvous_timeout_secs);
  EXPECT_EQ(o.max_tokens_per_call, defaults.max_tokens_per_call);
  EXPECT_EQ(o.max_batch_tokens, defaults.max_batch_tokens);
  EXPECT_EQ(o.log_level, defaults.log_level);
}

TEST(ServerFlagsTest, OnlyKebabCaseServerFlagsWithStrictValues) {
  // The absl names are not spelled on the command line, and absl's own flags
  // are not tally-server's.
  for (const char* unknown : {"--grpc_port=1", "--flagfile=/etc/passwd"}) {
    auto flags = Parse({unknown});
    EXPECT_EQ(flags.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(flags.status().message().find("unknown flag"), std::string::npos)
        << flags.status();
  }
  // Booleans are true or false (absl alone would also take 1, yes, t).
  for (const char* bad :
       {"--demo-model=yes", "--resume=1", "--overlap-grad-sync=t"}) {
    EXPECT_FALSE(Parse({bad}).ok()) << bad;
  }
  // An unset override is a flag left out, not an empty value.
  EXPECT_FALSE(Parse({"--rank="}).ok());
  EXPECT_FALSE(Parse({"--master-addr", ""}).ok());
  // absl's parse errors name the flag as it is typed.
  auto flags = Parse({"--max-batch-tokens=many"});
  EXPECT_EQ(flags.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(flags.status().message().find("--max-batch-tokens"),
            std::string::npos)
      << flags.status();
  EXPECT_EQ(flags.status().message().find("max_batch_tokens"),
            std::string::npos)
      << flags.status();
}

TEST(ServerFlagsTest, UsageListsEveryFlagWithItsDefault) {
  const std::string usage = ServerUsage();
  int documented = 0;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::EndsWith(flag->Filename(), "server/flags.cc")) continue;
    ++documented;
    const std::string kebab = absl::StrReplaceAll(name, {{"_", "-"}});
    // "  --grpc-port N ...", "  --demo-model   ...": booleans take no value.
    const std::string start = absl::StrCat("\n  --", kebab, " ");
    const size_t at = usage.find(start);
    ASSERT_NE(at, std::string::npos) << kebab;
    const char after = usage[at + start.size()];
    EXPECT_EQ(flag->IsOfType<bool>(), !(after >= 'A' && after <= 'Z')) << kebab;
    const std::string entry =
        usage.substr(at, usage.find("\n  --", at + 1) - at);
    const std::string default_value = flag->DefaultValue();
    EXPECT_NE(
        entry.find(absl::StrCat(
            "(default: ", default_value.empty() ? "none" : default_value, ")")),
        std::string::npos)
        << entry;
  }
  EXPECT_GE(documented, 40);
  int defaults = 0;
  for (size_t at = usage.find("(default: "); at != std::string::npos;
       at = usage.find("(default: ", at + 1)) {
    ++defaults;
  }
  EXPECT_EQ(defaults, documented);  // no entry without its absl flag
  EXPECT_NE(usage.find("(default: 50051)"), std::string::npos) << usage;
  EXPECT_NE(usage.find("(default: 127.0.0.1)"), std::string::npos) << usage;
  for (const char* section :
       {"\nServing:\n", "\nMesh and parallelism:\n", "\nCheckpoints:\n",
        "\nSecurity:\n", "\nMetrics and logging:\n"}) {
    EXPECT_NE(usage.find(section), std::string::npos) << section;
  }
}

TEST(ConvertTest, ModelIdsAreRestricted) {
  EXPECT_TRUE(ValidateModelId("llama-3.1_sft").ok());
  EXPECT_FALSE(ValidateModelId("").ok());
  EXPECT_FALSE(ValidateModelId(std::string(129, 'a')).ok());
  auto status = ValidateModelId("../etc");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("model_id"), std::string::npos);
}

TEST(ConvertTest, UnknownEnumValuesAndBadHyperparametersAreRefused) {
  v1::ForwardBackwardRequest fb;
  fb.set_model_id("m");
  fb.add_samples()->add_input_tokens(1);
  fb.set_reduction(static_cast<v1::LossReduction>(99));
  auto args = ParseForwardBackward(fb);
  EXPECT_NE(args.status().message().find("reduction"), std::string::npos);

  v1::OptimStepRequest step;
  step.set_model_id("m");
  step.set_max_grad_norm(-1);
  EXPECT_NE(ParseOptimStep(step).status().message().find("max_grad_norm"),
            std::string::npos);
  step.clear_max_grad_norm();
  step.set_norm_type(static_cast<v1::NormType>(7));
  EXPECT_NE(ParseOptimStep(step).status().message().find("norm_type"),
            std::string::npos);

  v1::CreateModelRequest create;
  create.set_optimizer(v1::OPTIMIZER_SGD);
  create.mutable_default_adam()->set_beta1(0.5);
  EXPECT_EQ(ParseCreateModel(create).status().code(),
            absl::StatusCode::kInvalidArgument);
  create.clear_default_adam();
  create.mutable_config()->set_vocab_size(10);
  create.mutable_config()->set_hidden_size(30);
  create.mutable_config()->set_intermediate_size(8);
  create.mutable_config()->set_num_hidden_layers(1);
  create.mutable_config()->set_num_attention_heads(4);  // 30 % 4 != 0
  auto spec = ParseCreateModel(create);
  EXPECT_NE(spec.status().message().find("config.num_attention_heads"),
            std::string::npos)
      << spec.status();
}

TEST(ConvertTest, AbsentConfigMeansTheEmbeddedDefault) {
  v1::CreateModelRequest create;
  auto spec = ParseCreateModel(create);
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->config, LlamaConfig::EmbeddedDefault());
  EXPECT_EQ(spec->dtype, DType::kFloat32);
  EXPECT_EQ(spec->optimizer, OptimizerKind::kAdamW);
}

}  // namespace
}  // namespace tally
