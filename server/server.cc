#include "server/server.h"

#include <chrono>
#include <fstream>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "runtime/log.h"
#include "runtime/status.h"

namespace tally {
namespace {

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
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TallyServer>> TallyServer::Start(
    const ServerOptions& options) {
  if (options.max_message_bytes < 1024 ||
      options.max_message_bytes > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-message-bytes must be in [1024, 2^31), got ",
        options.max_message_bytes));
  }
  std::unique_ptr<TallyServer> s(new TallyServer());
  s->options_ = options;
  EngineOptions engine_options;
  engine_options.max_batch_tokens = options.max_batch_tokens;
  TALLY_ASSIGN_OR_RETURN(s->engine_, Engine::CreateSingleRank(engine_options));
  TALLY_ASSIGN_OR_RETURN(
      s->metrics_,
      ServerMetrics::Create(absl::StrCat(options.host, ":", options.metrics_port)));
  s->executor_ = std::make_unique<CommandExecutor>();

  if (options.demo_model) {
    ModelSpec spec;
    spec.model_id = kDemoModelId;
    spec.config = LlamaConfig::EmbeddedDefault();
    spec.default_max_grad_norm = 1.0;
    TALLY_RETURN_IF_ERROR(s->engine_->CreateModel(spec).status());
    s->metrics_->SetModelCount(s->engine_->num_models());
    Log(LogLevel::kInfo, absl::StrCat("created model '", kDemoModelId, "' (",
                                      spec.config.NumParameters(),
                                      " parameters)"));
  }

  s->service_ = std::make_unique<TrainerService>(
      s->engine_.get(), s->executor_.get(), s->metrics_.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(options.host, ":", options.grpc_port),
                           grpc::InsecureServerCredentials(), &s->grpc_port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->grpc_port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", options.host, ":", options.grpc_port));
  }
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  Log(LogLevel::kInfo,
      absl::StrCat("serving tally.v1.Trainer on ", options.host, ":",
                   s->grpc_port_, ", metrics on http://", options.host, ":",
                   s->metrics_->port(), "/metrics"));
  if (!options.port_file.empty()) {
    TALLY_RETURN_IF_ERROR(WritePortFile(options.port_file, s->grpc_port_,
                                        s->metrics_->port()));
  }
  return s;
}

TallyServer::~TallyServer() { Shutdown(); }

void TallyServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (server_) {
    // Load balancers and probes see NOT_SERVING before the port closes.
    server_->GetHealthCheckService()->SetServingStatus(false);
    Log(LogLevel::kInfo, "shutting down: finishing in-flight requests");
    const auto deadline =
        std::chrono::system_clock::now() +
        std::chrono::milliseconds(
            static_cast<int64_t>(options_.shutdown_timeout_secs * 1000));
    // Waits for queued commands, which the executor is still running.
    server_->Shutdown(deadline);
  }
  if (executor_) executor_->Stop();
  Log(LogLevel::kInfo, "shut down");
}

}  // namespace tally
