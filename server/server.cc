#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/file_text.h"
#include "base/log.h"
#include "base/status.h"
#include "runtime/config/address.h"
#include "runtime/parallel/compute_backend.h"
#include "runtime/parallel/device_query.h"
#include "server/admission.h"
#include "server/commands.h"
#include "server/listen_port.h"
#include "server/server_info.h"
#include "server/token_auth_processor.h"

namespace tally {
namespace {

std::optional<std::string> GetEnv(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

// The ranks on this host (LOCAL_WORLD_SIZE, set by the local launcher and
// torchrun), which share its memory.
int LocalRanks() {
  const std::optional<std::string> value = GetEnv("LOCAL_WORLD_SIZE");
  int ranks = 1;
  if (!value || !absl::SimpleAtoi(*value, &ranks) || ranks < 1) return 1;
  return ranks;
}

// The BLAS decides LibTorch's CPU speed: say which one this rank runs.
void LogComputeBackend(const ComputeBackend& backend) {
  Log(LogLevel::kInfo, absl::StrCat("compute: ", backend.Describe()));
  if (backend.slow_blas()) {
    Log(LogLevel::kWarning,
        "compute: the reference BLAS is active; matmuls run ~15x slower than "
        "with BLIS (install libblis4-pthread, which Debian's alternatives "
        "then pick for libblas.so.3; docs/performance.md)");
  }
}

// Ranks sharing a host (the local launcher, torchrun) get distinct ports:
// base + local rank; 0 stays "any free port".
absl::StatusOr<int> LocalRankPort(const ServerOptions& options, int base,
                                  const char* flag) {
  if (base == 0) return 0;
  TALLY_ASSIGN_OR_RETURN(RankEnv env, ResolveRankEnv(options.rank_env, GetEnv));
  const int port = base + env.local_rank;
  if (port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", base, " + local rank ", env.local_rank, " is past 65535"));
  }
  return port;
}

// The device of this rank (runtime/parallel/device.h): the same on every call,
// from --device, the rank's place on its host and the GPUs this process sees.
absl::StatusOr<RankDevice> ChooseRankDevice(const ServerOptions& options) {
  TALLY_ASSIGN_OR_RETURN(RankEnv env, ResolveRankEnv(options.rank_env, GetEnv));
  return ResolveDevice(options.device, env.local_rank, LocalRanks(),
                       DetectGpus());
}

// Memory admission's limit: on a CPU rank --max-memory-bytes or the rank's
// share of the host's memory; on a CUDA rank the device's
// (DeviceMemoryLimit), or --max-memory-bytes when lower.
absl::StatusOr<MemoryLimit> AdmissionLimit(const ServerOptions& options,
                                           const torch::Device& device) {
  if (!device.is_cuda()) {
    return MemoryLimit{
        static_cast<double>(options.max_memory_bytes > 0
                                ? options.max_memory_bytes
                                : DefaultMemoryLimitBytes(LocalRanks())),
        "--max-memory-bytes"};
  }
  TALLY_ASSIGN_OR_RETURN(DeviceMemoryInfo memory,
                         QueryDeviceMemory(device.index()));
  const AllocatorBytes held = CachingAllocatorBytes(device);
  const MemoryLimit limit = DeviceMemoryLimit(
      {device.str(), static_cast<double>(memory.free_bytes),
       static_cast<double>(memory.total_bytes),
       static_cast<double>(held.reserved), static_cast<double>(held.allocated)},
      options.max_memory_bytes);
  Log(LogLevel::kInfo, absl::StrCat("memory admission: ", limit.bytes,
                                    " bytes, from ", limit.name));
  return limit;
}

absl::Status WritePortFile(const std::string& path, int grpc_port,
                           int metrics_port) {
  // Written whole then renamed, so a watcher never reads half a file.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "{\"grpc_port\": " << grpc_port
        << ", \"metrics_port\": " << metrics_port << "}\n";
    if (!out) {
      return absl::InternalError(absl::StrCat("cannot write ", tmp));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// Settings every rank must share: the micro-batch plan decides how many
// collectives a ForwardBackward issues, and the demo model must exist
// everywhere. An external launcher may pass ranks different flags.
absl::Status CheckSameOnEveryRank(Communicator& world,
                                  const ServerOptions& options) {
  if (world.size() == 1) return absl::OkStatus();
  const std::vector<std::pair<const char*, double>> settings = {
      {"--max-batch-tokens", static_cast<double>(options.max_batch_tokens)},
      {"--bucket-mb", static_cast<double>(options.bucket_mb)},
      {"--pp-microbatches", static_cast<double>(options.pp_microbatches)},
      {"--attention", static_cast<double>(options.attention.mode)},
      {"--attention-block-keys",
       static_cast<double>(options.attention.block_keys)},
      {"--zero-stage", static_cast<double>(options.zero_stage)},
      {"--demo-model", options.demo_model ? 1.0 : 0.0}};
  std::vector<double> values;
  for (const auto& [flag, value] : settings) values.push_back(value);
  torch::Tensor high = torch::tensor(values, torch::kFloat64);
  torch::Tensor negated_low = -high;
  TALLY_RETURN_IF_ERROR(world.AllReduce(high, ReduceOp::kMax));
  TALLY_RETURN_IF_ERROR(world.AllReduce(negated_low, ReduceOp::kMax));
  for (size_t i = 0; i < settings.size(); ++i) {
    if (high[i].item<double>() != -negated_low[i].item<double>()) {
      return absl::FailedPreconditionError(
          absl::StrCat(settings[i].first,
                       " differs between ranks; every rank needs the "
                       "same value"));
    }
  }
  return absl::OkStatus();
}

// A rank's serving state as its probes see it: gRPC health (service "")
// and the metrics port's /readyz, `reason` saying why when not serving.
void SetServing(grpc::Server& server, ServerMetrics& metrics, bool serving,
                const std::string& reason = "") {
  server.GetHealthCheckService()->SetServingStatus(serving);
  metrics.SetReady(serving, reason);
}

// A rank of a multi-rank world stops making progress when a peer is dead or
// hung: its /readyz turns 503 once a collective failed or a command has run
// longer than a collective may wait. Null (nothing watched) on one rank,
// whose commands wait for no peer.
std::unique_ptr<ProgressWatch> WatchProgress(const ServerOptions& options,
                                             const Engine& engine) {
  if (engine.mesh().world_size() == 1) return nullptr;
  return std::make_unique<ProgressWatch>(
      absl::Seconds(options.collective_timeout_secs));
}

// /readyz's check for `watch` (null: none), which outlives `metrics`.
void SetReadinessCheck(ServerMetrics& metrics, const Engine& engine,
                       const ProgressWatch* watch) {
  if (watch == nullptr) return;
  metrics.SetReadinessCheck([&engine, watch] {
    TALLY_RETURN_IF_ERROR(engine.CollectiveFailure());
    return watch->Check();
  });
}

absl::StatusOr<std::string> ReadPem(const char* flag, const std::string& path) {
  const std::string what = absl::StrCat("--", flag);
  TALLY_ASSIGN_OR_RETURN(std::string text, ReadFileText(path, what));
  if (text.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot read ", path, " (empty)"));
  }
  return text;
}

// TLS (mutual with --tls-client-ca) or plaintext, which only a loopback
// address gets unless --allow-insecure-remote.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const ServerOptions& options) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (options.tls_cert.empty()) {
    if (!options.tls_client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs --tls-cert and --tls-key");
    }
    if (!IsLoopbackHost(options.host) && !options.allow_insecure_remote) {
      return absl::FailedPreconditionError(absl::StrCat(
          "refusing to serve plaintext on non-loopback --host ", options.host,
          "; give --tls-cert and --tls-key, or --allow-insecure-remote"));
    }
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions ssl(
      options.tls_client_ca.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  TALLY_ASSIGN_OR_RETURN(pair.private_key, ReadPem("tls-key", options.tls_key));
  TALLY_ASSIGN_OR_RETURN(pair.cert_chain,
                         ReadPem("tls-cert", options.tls_cert));
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!options.tls_client_ca.empty()) {
    TALLY_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                           ReadPem("tls-client-ca", options.tls_client_ca));
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> CreateRankEngine(
    const ServerOptions& options) {
  TALLY_ASSIGN_OR_RETURN(RankEnv env, ResolveRankEnv(options.rank_env, GetEnv));
  SetLogRank(env.rank);  // every line of this process from now on
  // Before the first matmul: BLIS reads its thread count once, at its first
  // call.
  TALLY_RETURN_IF_ERROR(SetComputeThreads(
      options.threads > 0 ? options.threads
                          : DefaultComputeThreads(LocalRanks())));
  LogComputeBackend(DetectComputeBackend());
  EngineOptions engine_options;
  engine_options.max_batch_tokens = options.max_batch_tokens;
  engine_options.bucket_mb = options.bucket_mb;
  engine_options.pp_microbatches = static_cast<int>(options.pp_microbatches);
  engine_options.overlap_grad_sync = options.overlap_grad_sync;
  engine_options.attention = options.attention;
  engine_options.zero_stage = options.zero_stage;
  TALLY_ASSIGN_OR_RETURN(const RankDevice device, ChooseRankDevice(options));
  Log(LogLevel::kInfo,
      absl::StrCat("device: ", device.device.str(), " (", device.why, ")"));
  engine_options.device = device.device;
  engine_options.allow_tf32 = options.allow_tf32;
  if (env.world_size != options.mesh.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the world has ", env.world_size, " ranks (from ",
                     env.source, ") but the mesh (", options.mesh.ToString(),
                     ") needs ", options.mesh.world_size()));
  }
  TALLY_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(options.mesh, env.rank));
  std::unique_ptr<Engine> engine;
  if (env.world_size == 1) {
    TALLY_ASSIGN_OR_RETURN(engine, Engine::CreateSingleRank(engine_options));
  } else {
    // ProcessGroups::Create logs the rank, its source, master and mesh.
    TALLY_ASSIGN_OR_RETURN(
        auto groups,
        ProcessGroups::Create(
            env, mesh, absl::Seconds(options.rendezvous_timeout_secs),
            absl::Seconds(options.collective_timeout_secs), device.device));
    TALLY_ASSIGN_OR_RETURN(
        engine, Engine::Create(engine_options, mesh, std::move(groups)));
  }
  TALLY_RETURN_IF_ERROR(CheckSameOnEveryRank(engine->world(), options));
  if (options.demo_model) {
    // Every rank creates it, in the same order, before any command.
    ModelSpec spec;
    spec.model_id = kDemoModelId;
    spec.config = LlamaConfig::EmbeddedDefault();
    spec.default_max_grad_norm = 1.0;
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    Log(LogLevel::kInfo,
        absl::StrCat("created model '", kDemoModelId, "' (",
                     spec.config.NumParameters(), " parameters)"));
  }
  return engine;
}

namespace {

// The flags that must agree with each other, checked before anything
// starts: what needs --checkpoint-dir, tenants' confinement, the exit budget.
// Creates --checkpoint-root if it is missing.
absl::Status ValidateCheckpointAndShutdownFlags(const ServerOptions& options) {
  if (options.resume && options.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError("--resume needs --checkpoint-dir");
  }
  if (options.checkpoint_every_steps > 0 && options.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint-every-steps needs --checkpoint-dir");
  }
  if (options.checkpoint_on_exit && options.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint-on-exit needs --checkpoint-dir");
  }
  if (options.shutdown_drain_secs > 0 &&
      options.shutdown_drain_secs >= options.exit_timeout_secs) {
    // The drain would use up the whole exit budget: every shutdown would
    // end in the watchdog's exit 1, without the exit checkpoint.
    return absl::InvalidArgumentError(absl::StrCat(
        "--shutdown-drain-secs (", options.shutdown_drain_secs,
        ") must be less than --exit-timeout-secs (", options.exit_timeout_secs,
        "), which bounds the whole shutdown, drain included"));
  }
  if (!options.auth_tokens_file.empty() && options.checkpoint_root.empty()) {
    // Without a root, a tenant's checkpoint path may name another tenant's
    // checkpoint: read it, or overwrite it.
    return absl::InvalidArgumentError(
        "--auth-tokens-file needs --checkpoint-root: tenants' checkpoint "
        "paths must be confined, each to <root>/<tenant>");
  }
  if (options.checkpoint_root.empty()) return absl::OkStatus();
  std::error_code error;
  std::filesystem::create_directories(options.checkpoint_root, error);
  if (!std::filesystem::is_directory(options.checkpoint_root, error)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--checkpoint-root ", options.checkpoint_root,
                     " is not a directory and cannot be created"));
  }
  if (!options.checkpoint_dir.empty()) {
    // The server's own checkpoints must be out of every client's reach (a
    // tenant named like their folder would reach all of them), and clients'
    // ones out of --resume's.
    auto resolved = [&error](const std::string& path) {
      std::filesystem::path p = std::filesystem::weakly_canonical(path, error);
      return p.filename().empty() ? p.parent_path() : p;  // a trailing "/"
    };
    const std::filesystem::path root = resolved(options.checkpoint_root);
    const std::filesystem::path dir = resolved(options.checkpoint_dir);
    auto within = [](const std::filesystem::path& inner,
                     const std::filesystem::path& outer) {
      const auto [end, unused] =
          std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end());
      return end == outer.end();
    };
    if (within(dir, root) || within(root, dir)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--checkpoint-dir ", options.checkpoint_dir,
          " and --checkpoint-root ", options.checkpoint_root,
          " overlap: the server's own checkpoints must be outside every "
          "client's reach, and clients' outside --resume's"));
    }
  }
  return absl::OkStatus();
}

// The credentials /metrics requires, if any. Its series name every tenant's
// models, so with tenants on a non-loopback address it must require some.
absl::StatusOr<std::optional<BasicCredentials>> MetricsScraper(
    const ServerOptions& options) {
  if (options.metrics_auth_file.empty()) {
    if (!options.auth_tokens_file.empty() && !IsLoopbackHost(options.host)) {
      return absl::InvalidArgumentError(
          "--auth-tokens-file on a non-loopback --host needs "
          "--metrics-auth-file: /metrics names every tenant's models");
    }
    return std::nullopt;
  }
  TALLY_ASSIGN_OR_RETURN(BasicCredentials scraper,
                         BasicCredentials::FromFile(options.metrics_auth_file));
  return scraper;
}

// The request queues' bounds and the sequencing of --seq-* flags.
void SetQueueOptions(const ServerOptions& options,
                     TrainerServiceOptions& service_options) {
  service_options.sequencing.gap_timeout =
      absl::Seconds(options.seq_gap_timeout_secs);
  service_options.sequencing.cache_size =
      static_cast<size_t>(options.seq_cache);
  service_options.budget.total =
      static_cast<size_t>(options.max_queued_requests);
  service_options.budget.per_tenant =
      static_cast<size_t>(options.max_queued_requests_per_tenant);
  service_options.budget.per_model =
      static_cast<size_t>(options.max_queued_requests_per_model);
}

// The gRPC server of `service` (with health checks and reflection) on
// --host:--grpc-port; `*port` is set to the port it listens on. UNAVAILABLE
// when it cannot listen there.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const ServerOptions& options,
    std::shared_ptr<grpc::ServerCredentials> credentials,
    grpc::Service* service, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // A port another process listens on is refused, not shared.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(absl::StrCat(options.host, ":", options.grpc_port),
                           std::move(credentials), port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *port == 0) {
    return absl::UnavailableError(absl::StrCat("--grpc-port: cannot listen on ",
                                               options.host, ":",
                                               options.grpc_port));
  }
  return server;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TallyServer>> TallyServer::Start(
    const ServerOptions& options, std::unique_ptr<Engine> engine) {
  if (options.max_message_bytes < 1024 ||
      options.max_message_bytes > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-message-bytes must be in [1024, 2^31), got ",
                     options.max_message_bytes));
  }
  std::unique_ptr<TallyServer> s(new TallyServer());
  s->options_ = options;
  s->engine_ = std::move(engine);
  s->progress_ = WatchProgress(options, *s->engine_);
  TALLY_ASSIGN_OR_RETURN(
      const int metrics_port,
      LocalRankPort(options, options.metrics_port, "--metrics-port"));
  TALLY_RETURN_IF_ERROR(
      CheckCanListen(options.host, options.grpc_port, "--grpc-port"));
  TALLY_RETURN_IF_ERROR(
      CheckCanListen(options.host, metrics_port, "--metrics-port"));
  TALLY_ASSIGN_OR_RETURN(std::optional<BasicCredentials> scraper,
                         MetricsScraper(options));
  TALLY_ASSIGN_OR_RETURN(
      s->metrics_,
      ServerMetrics::Create(absl::StrCat(options.host, ":", metrics_port),
                            s->engine_.get(), std::move(scraper)));
  SetReadinessCheck(*s->metrics_, *s->engine_, s->progress_.get());
  s->liveness_ = std::make_unique<Liveness>();
  s->metrics_->SetLivenessCheck(
      [liveness = s->liveness_.get()] { return liveness->Check(); });
  TALLY_ASSIGN_OR_RETURN(const RankDevice device, ChooseRankDevice(options));
  s->metrics_->WatchDeviceMemory(device.device);
  TALLY_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                         ServerCredentials(options));
  TALLY_RETURN_IF_ERROR(ValidateCheckpointAndShutdownFlags(options));
  TrainerServiceOptions service_options;
  service_options.max_message_bytes = options.max_message_bytes;
  service_options.max_batch_tokens = options.max_batch_tokens;
  service_options.attention = options.attention;
  service_options.max_tokens_per_call = options.max_tokens_per_call;
  service_options.memory.per_tenant_bytes =
      static_cast<double>(options.max_memory_bytes_per_tenant);
  TALLY_ASSIGN_OR_RETURN(const MemoryLimit limit,
                         AdmissionLimit(options, device.device));
  service_options.memory.limit_bytes = limit.bytes;
  service_options.memory.limit_name = limit.name;
  service_options.devices =
      DescribeDevices(device, options.allow_tf32, QueryCudaFacts());
  service_options.checkpoint_root = options.checkpoint_root;
  service_options.models_root = options.models_root;
  if (!options.auth_tokens_file.empty()) {
    TALLY_ASSIGN_OR_RETURN(s->authenticator_,
                           Authenticator::FromFile(options.auth_tokens_file));
    service_options.authenticator = s->authenticator_.get();
    if (!options.tls_cert.empty()) {
      // Tokens are checked before a body is parsed (see the processor).
      ServerMetrics* metrics = s->metrics_.get();
      credentials->SetAuthMetadataProcessor(
          std::make_shared<TokenAuthProcessor>(
              s->authenticator_.get(), [metrics](const std::string& reason) {
                metrics->RecordAuthFailure(reason);
              }));
    }
  }
  s->checkpointer_ = std::make_unique<Checkpointer>(
      CheckpointerOptions{options.checkpoint_dir,
                          options.checkpoint_every_steps,
                          options.checkpoint_keep,
                          /*tenant_dirs=*/s->authenticator_ != nullptr},
      s->engine_.get(), &s->engine_->control(), s->metrics_.get());
  service_options.checkpointer = s->checkpointer_.get();
  service_options.progress = s->progress_.get();
  if (options.resume) {
    // Before serving, so no request sees a model half resumed.
    s->resume_ = s->checkpointer_->Resume();
  }
  s->metrics_->SetModelCount(s->engine_->num_models());
  s->executor_ = std::make_unique<CommandExecutor>(s->liveness_.get());
  service_options.sequencing.liveness = s->liveness_.get();

  SetQueueOptions(options, service_options);
  TallyServer* server = s.get();
  service_options.on_rank_failure = [server](const absl::Status& failure) {
    server->OnRankFailure(failure);
  };
  s->service_ = std::make_unique<TrainerService>(
      s->engine_.get(), s->executor_.get(), s->metrics_.get(),
      std::move(service_options));
  // The resumed models continue their seq_ids where the checkpoint left them.
  for (const ResumedModel& resumed : s->resume_.resumed) {
    TALLY_RETURN_IF_ERROR(
        s->service_->RestoreSequencing(resumed.model_id, resumed.server_state));
  }
  s->service_->ReportUnresumed(s->resume_.failed);
  TALLY_ASSIGN_OR_RETURN(s->server_,
                         StartGrpcServer(options, std::move(credentials),
                                         s->service_.get(), &s->grpc_port_));
  SetServing(*s->server_, *s->metrics_, true);
  Log(LogLevel::kInfo,
      absl::StrCat("serving tally.v1.Trainer on ", options.host, ":",
                   s->grpc_port_, ", metrics on http://", options.host, ":",
                   s->metrics_->port(), "/metrics"));
  if (!options.port_file.empty()) {
    TALLY_RETURN_IF_ERROR(
        WritePortFile(options.port_file, s->grpc_port_, s->metrics_->port()));
  }
  s->served_ = true;
  return s;
}

TallyServer::~TallyServer() { Shutdown().IgnoreError(); }

absl::Status ServeWorkerRank(const ServerOptions& options,
                             std::unique_ptr<Engine> engine) {
  const int rank = engine->mesh().rank();
  TALLY_ASSIGN_OR_RETURN(
      const int metrics_port,
      LocalRankPort(options, options.metrics_port, "--metrics-port"));
  TALLY_ASSIGN_OR_RETURN(
      const int grpc_port,
      LocalRankPort(options, options.grpc_port, "--grpc-port"));
  TALLY_RETURN_IF_ERROR(CheckCanListen(options.host, grpc_port, "--grpc-port"));
  TALLY_RETURN_IF_ERROR(
      CheckCanListen(options.host, metrics_port, "--metrics-port"));
  TALLY_ASSIGN_OR_RETURN(std::optional<BasicCredentials> scraper,
                         MetricsScraper(options));
  const std::unique_ptr<ProgressWatch> progress =
      WatchProgress(options, *engine);
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<ServerMetrics> metrics,
      ServerMetrics::Create(absl::StrCat(options.host, ":", metrics_port),
                            engine.get(), std::move(scraper)));
  SetReadinessCheck(*metrics, *engine, progress.get());
  metrics->WatchDeviceMemory(engine->device());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int bound_grpc_port = 0;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(absl::StrCat(options.host, ":", grpc_port),
                           grpc::InsecureServerCredentials(), &bound_grpc_port);
  std::unique_ptr<grpc::Server> health = builder.BuildAndStart();
  if (!health || bound_grpc_port == 0) {
    return absl::UnavailableError(absl::StrCat("--grpc-port: cannot listen on ",
                                               options.host, ":", grpc_port));
  }
  SetServing(*health, *metrics, true);
  Log(LogLevel::kInfo,
      absl::StrCat("rank ", rank, ": health on ", options.host, ":",
                   bound_grpc_port, ", metrics on http://", options.host, ":",
                   metrics->port(), "/metrics"));
  if (!options.port_file.empty()) {
    TALLY_RETURN_IF_ERROR(
        WritePortFile(absl::StrCat(options.port_file, ".rank", rank),
                      bound_grpc_port, metrics->port()));
  }
  absl::Status status =
      CommandLoop(*engine, engine->control(), metrics.get(), progress.get());
  SetServing(*health, *metrics, false,
             absl::StrCat("rank ", rank, " stopped: ", status.ToString()));
  health->Shutdown();
  return status;
}

absl::Status TallyServer::failure() const {
  absl::MutexLock lock(&failure_mu_);
  return failure_;
}

void TallyServer::OnRankFailure(const absl::Status& failure) {
  {
    absl::MutexLock lock(&failure_mu_);
    failure_ = failure;
  }
  // Probes see it at once; Shutdown follows from main.
  SetServing(*server_, *metrics_, false,
             absl::StrCat("a rank failed: ", failure.ToString()));
}

// How long gRPC's shutdown may wait for clients to go once every request
// was answered.
constexpr absl::Duration kConnectionGrace = absl::Milliseconds(500);

absl::Status TallyServer::Shutdown() {
  if (shut_down_) return failure();
  shut_down_ = true;
  const absl::Status failed = failure();
  if (server_) {
    // Load balancers and probes see NOT_SERVING before anything is refused.
    SetServing(*server_, *metrics_, false, "shutting down");
    if (failed.ok() && options_.shutdown_drain_secs > 0) {
      Log(LogLevel::kInfo,
          absl::StrCat("shutting down: NOT_SERVING, still serving for ",
                       options_.shutdown_drain_secs, " s"));
      absl::SleepFor(absl::Seconds(options_.shutdown_drain_secs));
    }
    Log(LogLevel::kInfo,
        "shutting down: finishing executing requests, refusing the rest");
    service_->StopExecuting();
    // The executor completes the executing request and answers the queued
    // ones UNAVAILABLE, so every RPC of the service has its answer when it
    // stops; main's watchdog bounds that by --exit-timeout-secs.
    if (executor_) executor_->Stop();
    // Nothing is left to wait for but the answers' delivery and connections:
    // clients that stay connected (idle channels, health watches) are cut
    // after a short grace instead of holding the exit back.
    server_->Shutdown(absl::ToChronoTime(absl::Now() + kConnectionGrace));
  }
  if (executor_) executor_->Stop();
  // After a rank failure the groups are unusable; the other ranks exit on
  // their own broken collectives.
  if (engine_ && failed.ok()) {
    // No command runs any more, and the other ranks still take part. main's
    // watchdog bounds it too; an unfinished write leaves the previous
    // checkpoint.
    if (options_.checkpoint_on_exit && served_ && failure().ok()) {
      checkpointer_->SaveAllOnExit();
    }
    absl::Status told = ReplicateCommand(engine_->control(), Command::kShutdown,
                                         v1::ListModelsRequest());
    if (!told.ok()) {
      Log(LogLevel::kWarning,
          absl::StrCat("could not stop the other ranks: ", told.ToString()));
    }
  }
  Log(LogLevel::kInfo, failed.ok() ? "shut down" : "shut down after a failure");
  return failed;
}

}  // namespace tally
