// TallyServer: a running tally server: the engine, its command executor, the
// gRPC endpoint (tally.v1.Trainer, grpc.health.v1.Health, reflection) and the
// Prometheus endpoint, with an orderly shutdown.
//
//   tally::ServerOptions options;
//   options.grpc_port = 0;  // any free port
//   TALLY_ASSIGN_OR_RETURN(auto server, tally::TallyServer::Start(options));
//   ... server->grpc_port() ...
//   server->Shutdown();  // health NOT_SERVING, finish in-flight work, stop
#ifndef TALLY_SERVER_SERVER_H_
#define TALLY_SERVER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/distributed.h"
#include "runtime/engine.h"
#include "runtime/mesh.h"
#include "server/executor.h"
#include "server/metrics.h"
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

  std::string host = "0.0.0.0";
  // Local rank r (LOCAL_RANK, set by the local launcher and torchrun) listens
  // on port + r, so ranks sharing a host do not collide; 0: any free port.
  int grpc_port = 50051;
  int metrics_port = 9090;
  int64_t max_message_bytes = int64_t{256} << 20;
  std::string log_level = "info";
  // Create model "demo" (the embedded default config) at start.
  bool demo_model = false;
  // Written as {"grpc_port": N, "metrics_port": M} once serving; ranks > 0
  // write theirs to "<port_file>.rank<R>".
  std::string port_file;
  int64_t max_batch_tokens = EngineOptions().max_batch_tokens;
  // How long Shutdown() lets in-flight RPCs finish before cancelling them.
  double shutdown_timeout_secs = 30;
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
  int metrics_port() const { return metrics_->port(); }

  // Health NOT_SERVING, in-flight requests finish, the other ranks are told
  // to stop. Idempotent.
  void Shutdown();

 private:
  TallyServer() = default;

  ServerOptions options_;
  std::unique_ptr<Engine> engine_;
  // Before metrics_, whose scrapes read its queue depth until destroyed.
  std::unique_ptr<CommandExecutor> executor_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<TrainerService> service_;
  std::unique_ptr<grpc::Server> server_;
  int grpc_port_ = 0;
  bool shut_down_ = false;
};

}  // namespace tally

#endif  // TALLY_SERVER_SERVER_H_
