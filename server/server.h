// TallyServer: a running tally server: the engine, its command executor, the
// gRPC endpoint (tally.v1.Trainer, grpc.health.v1.Health, reflection) and the
// Prometheus endpoint, with an orderly shutdown.
//
//   tally::ServerOptions options;
//   options.grpc_port = 0;  // any free port
//   TALLY_ASSIGN_OR_RETURN(auto server, tally::TallyServer::Start(options));
//   ... server->grpc_port() ...
//   server->Shutdown();  // health NOT_SERVING, drain, finish executing work
#ifndef TALLY_SERVER_SERVER_H_
#define TALLY_SERVER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/device.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/mesh.h"
#include "server/auth.h"
#include "server/checkpointer.h"
#include "server/executor.h"
#include "server/health.h"
#include "server/metrics.h"
#include "server/progress_watch.h"
#include "server/trainer_service.h"

namespace tally {

struct ServerOptions {
  // Local ranks to launch and supervise (> 1: this process is the launcher).
  int nproc_per_node = 1;
  // The mesh; the product of its sizes must equal the world size.
  MeshShape mesh;
  // Flags that override the torchrun / LeaderWorkerSet environment.
  RankEnvOverrides rank_env;
  double rendezvous_timeout_secs = 300;

  std::string host = "127.0.0.1";
  // Local rank r (LOCAL_RANK, set by the local launcher and torchrun) listens
  // on port + r, so ranks sharing a host do not collide; 0: any free port.
  int grpc_port = 50051;
  int metrics_port = 9090;
  int64_t max_message_bytes = int64_t{256} << 20;
  // Memory admission (docs/reliability.md): what this rank's models and a
  // call's activations may take, by estimate; 0: 80% of the machine's (or
  // the cgroup's) memory shared by the local ranks. Per tenant: 0, none.
  int64_t max_memory_bytes = 0;
  int64_t max_memory_bytes_per_tenant = 0;
  // Tokens of one ForwardBackward, all samples together.
  int64_t max_tokens_per_call = int64_t{1} << 20;
  std::string log_level = "info";
  std::string log_format = "text";  // --log-format: text or json
  // Create model "demo" (the embedded default config) at start.
  bool demo_model = false;
  // Written as {"grpc_port": N, "metrics_port": M} once serving; ranks > 0
  // write theirs to "<port_file>.rank<R>".
  std::string port_file;
  int64_t max_batch_tokens = EngineOptions().max_batch_tokens;
  AttentionOptions attention;
  // Intra-op threads of each rank, LibTorch's and the BLAS's; 0:
  // OMP_NUM_THREADS, else the cores this process may run on divided by the
  // ranks on the host (DefaultComputeThreads).
  int threads = 0;
  // Every rank needs the same value (checked at start-up).
  int64_t bucket_mb = EngineOptions().bucket_mb;
  // Micro-batches per call under pipeline parallelism; 0: --pp.
  int64_t pp_microbatches = EngineOptions().pp_microbatches;
  bool overlap_grad_sync = EngineOptions().overlap_grad_sync;
  // What --dp-shard shards (runtime/parallel/zero.h); every rank needs the
  // same.
  ZeroStage zero_stage = EngineOptions().zero_stage;
  // The device of each rank (runtime/parallel/device.h), decided at start.
  DeviceKind device = DeviceKind::kAuto;
  // Float32 matmuls on a GPU may round through TF32.
  bool allow_tf32 = false;

  // Reliability (docs/reliability.md).
  // How long a missing seq_id may hold back the requests behind it.
  double seq_gap_timeout_secs = 30;
  // Responses kept per model for retried sequenced requests.
  int64_t seq_cache = 64;
  // Requests held at once (waiting, queued or executing), overall and per
  // model; beyond them RESOURCE_EXHAUSTED.
  int64_t max_queued_requests = 1024;
  int64_t max_queued_requests_per_model = 256;
  // Of one authenticated tenant: below the total, so that one tenant (its
  // requests held behind a seq_id gap, say) cannot refuse the others.
  int64_t max_queued_requests_per_tenant = 512;
  // After SIGTERM: how long the server keeps serving while NOT_SERVING, for
  // load balancers to notice.
  double shutdown_drain_secs = 0;
  // After SIGTERM: the bound on the whole shutdown (drain included); a
  // process still running then exits 1.
  double exit_timeout_secs = 30;
  // How long a collective waits for a dead or hung rank.
  double collective_timeout_secs =
      absl::ToDoubleSeconds(kDefaultCollectiveTimeout);

  // Checkpoints (docs/checkpoints.md). Non-empty: client checkpoint paths
  // (SaveCheckpoint, LoadCheckpoint, init_checkpoint) must lie inside this
  // existing directory; relative ones are taken relative to it.
  std::string checkpoint_root;
  // Non-empty: CreateModel.init_checkpoint names such as "Org/Name" resolve
  // in this directory (server/models_root.h); GetServerInfo lists them.
  std::string models_root;
  // Periodic checkpoints and --resume: <dir>/<model_id>/step-<N>/ (with
  // auth, <dir>/<tenant>/<model_id>/step-<N>/).
  std::string checkpoint_dir;
  int64_t checkpoint_every_steps = 0;  // 0: no periodic checkpoints
  int checkpoint_keep = 3;             // newest periodic checkpoints kept
  bool resume = false;  // at start, load each model's newest valid one
  // At shutdown, once the executor finished, save every model there too.
  bool checkpoint_on_exit = false;

  // Access control (docs/security.md). TLS when both are set.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;     // set: clients must present a certificate
  std::string auth_tokens_file;  // "<token> <tenant>" lines
  // "<user>:<password>": HTTP Basic auth on every rank's /metrics.
  std::string metrics_auth_file;
  // Without TLS and tokens the server refuses a non-loopback --host.
  bool allow_insecure_remote = false;
};

inline constexpr char kDemoModelId[] = "demo";

// Builds this rank's engine: the rank environment, the mesh, the process
// groups (a rendezvous when the world has more than one rank), and the demo
// model when asked for.
absl::StatusOr<std::unique_ptr<Engine>> CreateRankEngine(
    const ServerOptions& options);

// Ranks > 0: serves this rank's metrics and grpc.health.v1 (what Kubernetes
// probes; no tally.v1.Trainer) while CommandLoop (commands.h) executes rank
// 0's commands, until rank 0 shuts the world down.
absl::Status ServeWorkerRank(const ServerOptions& options,
                             std::unique_ptr<Engine> engine);

// Rank 0's front end over `engine`: gRPC and metrics. Ranks > 0 run
// ServeWorkerRank instead.
class TallyServer {
 public:
  static absl::StatusOr<std::unique_ptr<TallyServer>> Start(
      const ServerOptions& options, std::unique_ptr<Engine> engine);
  ~TallyServer();

  int grpc_port() const { return grpc_port_; }
  // The periodic checkpoints and --resume (for the server state hooks).
  Checkpointer& checkpointer() { return *checkpointer_; }
  // What --resume loaded at start, and what it could not.
  const ResumeReport& resume_report() const { return resume_; }
  int metrics_port() const { return metrics_->port(); }

  // OK, or the failed collective after which the server must stop (health
  // is NOT_SERVING and every request is answered UNAVAILABLE already).
  absl::Status failure() const;

  // Health NOT_SERVING; unless a rank failed, the server keeps serving for
  // --shutdown-drain-secs; then requests that have not started executing get
  // UNAVAILABLE, executing ones finish, every model is checkpointed with
  // --checkpoint-on-exit, and the other ranks are told to stop.
  // Returns failure(). Idempotent.
  absl::Status Shutdown();

 private:
  TallyServer() = default;
  void OnRankFailure(const absl::Status& failure);

  ServerOptions options_;
  std::unique_ptr<Engine> engine_;
  // Before executor_ and service_, whose loops beat on it, and metrics_,
  // whose /healthz checks it.
  std::unique_ptr<Liveness> liveness_;
  // Before metrics_, whose scrapes read its queue depth until destroyed.
  std::unique_ptr<CommandExecutor> executor_;
  // Before metrics_, whose /readyz reads it (null on one rank).
  std::unique_ptr<ProgressWatch> progress_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<Authenticator> authenticator_;
  std::unique_ptr<Checkpointer> checkpointer_;
  ResumeReport resume_;
  std::unique_ptr<TrainerService> service_;
  std::unique_ptr<grpc::Server> server_;
  int grpc_port_ = 0;
  // Start succeeded. A failed start (a failed --resume) writes no exit
  // checkpoint over the good ones with half-resumed models.
  bool served_ = false;
  bool shut_down_ = false;
  mutable absl::Mutex failure_mu_;
  absl::Status failure_ ABSL_GUARDED_BY(failure_mu_);
};

}  // namespace tally

#endif  // TALLY_SERVER_SERVER_H_
