// TrainerService: the gRPC front end of tally.v1.Trainer (callback API).
//
// A handler validates its request's proto-level fields on the gRPC thread,
// then queues the command on the CommandExecutor, which replicates it to the
// other ranks (commands.h), runs it on the engine and finishes the RPC. A
// request whose client cancelled it or whose deadline passed while it waited is
// not executed.
//
//   tally::TrainerService service(engine.get(), &control, &executor,
//                                 metrics.get());
//   grpc::ServerBuilder builder;
//   builder.RegisterService(&service);
#ifndef TALLY_SERVER_TRAINER_SERVICE_H_
#define TALLY_SERVER_TRAINER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "runtime/engine.h"
#include "server/auth.h"
#include "server/checkpointer.h"
#include "server/executor.h"
#include "server/metrics.h"
#include "tally/v1/trainer.grpc.pb.h"

namespace tally {

// Access control and checkpoint settings of the service; the defaults turn
// each feature off.
struct TrainerServiceOptions {
  // Bearer tokens → tenants; a tenant's model ids are scoped to it (see
  // ScopedModelId in convert.h). Null: no authentication.
  const Authenticator* authenticator = nullptr;
  // Confines client checkpoint paths (ConfineToRoot), to <root>/<tenant>
  // with authentication. Empty: paths are used as given.
  std::string checkpoint_root;
  // Periodic checkpoints after OptimStep. Null: none.
  Checkpointer* checkpointer = nullptr;
};

class TrainerService final : public v1::Trainer::CallbackService {
 public:
  // `control`: the group mutating commands are replicated over (ranks > 0
  // run CommandLoop); a one-rank group in a single-rank deployment.
  TrainerService(Engine* engine, Communicator* control,
                 CommandExecutor* executor, ServerMetrics* metrics,
                 TrainerServiceOptions options = {})
      : engine_(engine),
        control_(control),
        executor_(executor),
        metrics_(metrics),
        options_(std::move(options)) {}

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
  // Finishes the RPC with UNAUTHENTICATED for bad credentials, with
  // `validation` if it failed, else scopes `*model_id` (the request's, when
  // given) to the caller's tenant, queues `command` and finishes with its
  // status once it ran.
  grpc::ServerUnaryReactor* Execute(const char* method,
                                    grpc::CallbackServerContext* context,
                                    absl::Status validation,
                                    std::function<absl::Status()> command,
                                    std::string* model_id = nullptr);
  void Finish(const char* method, grpc::ServerUnaryReactor* reactor,
              const absl::Status& status);
  // The caller's tenant ("" without authentication).
  absl::StatusOr<std::string> Authenticate(
      const grpc::CallbackServerContext& context);
  // Rewrites a client checkpoint path in place to its confined absolute
  // form; PERMISSION_DENIED when it escapes --checkpoint-root.
  absl::Status ConfinePath(const grpc::CallbackServerContext& context,
                           std::string* path);

  Engine* engine_;
  Communicator* control_;
  CommandExecutor* executor_;
  ServerMetrics* metrics_;
  TrainerServiceOptions options_;
};

}  // namespace tally

#endif  // TALLY_SERVER_TRAINER_SERVICE_H_
