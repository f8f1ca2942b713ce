// TrainerService: the gRPC front end of tally.v1.Trainer (callback API).
//
// A handler validates its request's proto-level fields on the gRPC thread,
// takes a slot of the request budget (RESOURCE_EXHAUSTED when full), then
// queues the command on the CommandExecutor — directly when unsequenced
// (seq_id 0), through the Sequencer (exactly once, in seq_id order) when
// sequenced. The executor replicates it to the other ranks (commands.h), runs
// it on the engine and finishes the RPC. A request whose client cancelled it
// or whose deadline passed before it ran is not executed.
//
// A failed collective (a dead or hung rank) makes the service answer every
// queued and new request UNAVAILABLE and calls `on_rank_failure`; the server
// then exits non-zero for its supervisor to restart it.
//
//   tally::TrainerService::Options options;
//   options.on_rank_failure = [&](const absl::Status& failure) { ... };
//   tally::TrainerService service(engine.get(), &executor, metrics.get(),
//                                 options);
//   grpc::ServerBuilder builder;
//   builder.RegisterService(&service);
//   ...
//   service.StopExecuting();  // at shutdown, before grpc::Server::Shutdown
#ifndef TALLY_SERVER_TRAINER_SERVICE_H_
#define TALLY_SERVER_TRAINER_SERVICE_H_

#include <google/protobuf/message.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "runtime/engine.h"
#include "server/executor.h"
#include "server/metrics.h"
#include "server/request_budget.h"
#include "server/sequencer.h"
#include "tally/v1/trainer.grpc.pb.h"

namespace tally {

class TrainerService final : public v1::Trainer::CallbackService {
 public:
  struct Options {
    SequencerOptions sequencing;
    size_t max_queued_requests = 1024;
    size_t max_queued_requests_per_model = 256;
    // Called once, on the executor thread, when a collective failed.
    std::function<void(const absl::Status& failure)> on_rank_failure;
  };

  // Mutating commands are replicated over engine->control() (ranks > 0 run
  // CommandLoop); the engine's existing models are registered for
  // sequencing.
  TrainerService(Engine* engine, CommandExecutor* executor,
                 ServerMetrics* metrics, Options options);

  // From now on requests that have not started executing are answered
  // UNAVAILABLE (not executed: a retry on the restarted server runs them);
  // executing ones finish.
  void StopExecuting();

  grpc::ServerUnaryReactor* CreateModel(grpc::CallbackServerContext* context,
                                        const v1::CreateModelRequest* request,
                                        v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const v1::ListModelsRequest* request,
      v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteModel(
      grpc::CallbackServerContext* context,
      const v1::DeleteModelRequest* request,
      v1::DeleteModelResponse* response) override;
  grpc::ServerUnaryReactor* ForwardBackward(
      grpc::CallbackServerContext* context,
      const v1::ForwardBackwardRequest* request,
      v1::ForwardBackwardResponse* response) override;
  grpc::ServerUnaryReactor* OptimStep(grpc::CallbackServerContext* context,
                                      const v1::OptimStepRequest* request,
                                      v1::OptimStepResponse* response) override;
  grpc::ServerUnaryReactor* AbortAccumulation(
      grpc::CallbackServerContext* context,
      const v1::AbortAccumulationRequest* request,
      v1::AbortAccumulationResponse* response) override;
  grpc::ServerUnaryReactor* SaveCheckpoint(
      grpc::CallbackServerContext* context,
      const v1::SaveCheckpointRequest* request,
      v1::SaveCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(
      grpc::CallbackServerContext* context,
      const v1::LoadCheckpointRequest* request,
      v1::LoadCheckpointResponse* response) override;

 private:
  // One RPC on its way through the service.
  struct Call {
    const char* method;
    grpc::CallbackServerContext* context;
    std::string model_id;  // "" for requests of no particular model
    uint64_t seq_id = 0;   // 0: unsequenced
    const google::protobuf::Message* request = nullptr;
    google::protobuf::Message* response = nullptr;
  };

  // Finishes the RPC with `validation` if it failed; otherwise queues
  // `command` and finishes with its status once it ran.
  grpc::ServerUnaryReactor* Execute(const Call& call, absl::Status validation,
                                    std::function<absl::Status()> command);
  // UNAVAILABLE once the service stopped executing or a rank failed.
  absl::Status Accepting() const;
  // Why the call must not run now, if it must not.
  absl::Status Precheck(grpc::CallbackServerContext* context) const;
  // Runs `command`, turning a collective failure into UNAVAILABLE.
  absl::Status RunCommand(const std::function<absl::Status()>& command);
  // Runs a command that may poison `model_id`'s window, counting it if so.
  absl::Status CountingPoison(const std::string& model_id,
                              const std::function<absl::Status()>& command);
  void PoisonForGap(const std::string& model_id);
  void OnRankFailure(const absl::Status& failure);
  void FillNextSeqId(v1::ModelInfo* info) const;
  void Finish(const char* method, grpc::ServerUnaryReactor* reactor,
              const absl::Status& status);

  Engine* engine_;
  CommandExecutor* executor_;
  ServerMetrics* metrics_;
  const Options options_;
  RequestBudget budget_;
  Sequencer sequencer_;
  std::atomic<bool> stopped_{false};
  mutable absl::Mutex failure_mu_;
  absl::Status rank_failure_ ABSL_GUARDED_BY(failure_mu_);
};

}  // namespace tally

#endif  // TALLY_SERVER_TRAINER_SERVICE_H_
