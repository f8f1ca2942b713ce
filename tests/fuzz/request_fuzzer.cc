// libFuzzer target: arbitrary bytes through the server's request parsing and
// validation (server/convert.h), the code every hostile client reaches
// first. The first byte picks the request type, the rest is parsed as that
// message; whatever parses must be validated without crashing, and what
// validation accepts must satisfy the invariants the engine relies on.
//
//   build/tests/fuzz/fuzzers-build/request_fuzzer -runs=20000
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "server/convert.h"
#include "tally/v1/trainer.pb.h"

namespace tally {
namespace {

// Aborts (a finding) when an accepted request breaks an invariant.
void Require(bool invariant) {
  if (!invariant) __builtin_trap();
}

void CheckModelId(const std::string& model_id) {
  if (!ValidateModelId(model_id).ok()) return;
  Require(!model_id.empty() && model_id.size() <= 128);
  Require(model_id.find('/') == std::string::npos);
  Require(model_id != "." && model_id != "..");
  Require(ClientModelId(ScopedModelId("tenant", model_id)) == model_id);
  Require(InTenant(ScopedModelId("tenant", model_id), "tenant"));
}

void FuzzCreateModel(const v1::CreateModelRequest& request) {
  CheckModelId(request.model_id());
  absl::StatusOr<ModelSpec> spec = ParseCreateModel(request);
  if (!spec.ok()) return;
  Require(spec->config.Validate().ok() || !spec->init_checkpoint.empty());
  Require(std::isfinite(spec->default_adam.learning_rate) ||
          !request.default_adam().has_learning_rate());
  Require(spec->lora.enabled() == request.has_lora());
  if (spec->lora.enabled()) {
    Require(ValidateLoraConfig(spec->lora).ok());
    Require(!BaseKey(*spec, "identity").empty());
  }
  ModelSummary summary;
  summary.model_id = spec->model_id;
  summary.config = spec->config;
  summary.lora = spec->lora;
  v1::ModelInfo info;
  ToProto(summary, &info);
  // ModelInfo reports the config that runs: read back, it is the same.
  if (request.has_config()) {
    v1::CreateModelRequest again;
    *again.mutable_config() = info.config();
    absl::StatusOr<ModelSpec> reread = ParseCreateModel(again);
    Require(reread.ok() && reread->config == spec->config);
    Require(info.config().head_dim() == spec->config.HeadDim());
  }
}

void FuzzForwardBackward(const v1::ForwardBackwardRequest& request) {
  CheckModelId(request.model_id());
  absl::StatusOr<ForwardBackwardArgs> args = ParseForwardBackward(request);
  if (!args.ok()) return;
  Require(!args->samples.empty());
  Require(static_cast<int>(args->samples.size()) == request.samples_size());
}

void FuzzOptimStep(const v1::OptimStepRequest& request) {
  CheckModelId(request.model_id());
  absl::StatusOr<OptimStepArgs> args = ParseOptimStep(request);
  if (!args.ok()) return;
  if (args->max_grad_norm.has_value()) {
    Require(std::isfinite(*args->max_grad_norm) && *args->max_grad_norm >= 0);
  }
}

template <typename Request>
void FuzzPathRequest(const Request& request) {
  CheckModelId(request.model_id());
  if (ValidateCheckpointPath(request.path()).ok()) {
    Require(!request.path().empty());
    Require(request.path().find('\0') == std::string::npos);
  }
}

void FuzzExportWeights(const v1::ExportWeightsRequest& request) {
  FuzzPathRequest(request);
  if (ParseExportWeights(request).ok()) {
    Require(ValidateCheckpointPath(request.path()).ok());
  }
}

template <typename Request>
bool Parse(const uint8_t* data, size_t size, Request* request) {
  return request->ParseFromArray(data, static_cast<int>(size));
}

}  // namespace
}  // namespace tally

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tally;
  if (size == 0) return 0;
  const uint8_t kind = data[0] % 7;
  ++data;
  --size;
  switch (kind) {
    case 0: {
      v1::CreateModelRequest request;
      if (Parse(data, size, &request)) FuzzCreateModel(request);
      break;
    }
    case 1: {
      v1::ForwardBackwardRequest request;
      if (Parse(data, size, &request)) FuzzForwardBackward(request);
      break;
    }
    case 2: {
      v1::OptimStepRequest request;
      if (Parse(data, size, &request)) FuzzOptimStep(request);
      break;
    }
    case 3: {
      v1::SaveCheckpointRequest request;
      if (Parse(data, size, &request)) FuzzPathRequest(request);
      break;
    }
    case 4: {
      v1::LoadCheckpointRequest request;
      if (Parse(data, size, &request)) FuzzPathRequest(request);
      break;
    }
    case 5: {
      v1::ExportWeightsRequest request;
      if (Parse(data, size, &request)) FuzzExportWeights(request);
      break;
    }
    default: {
      v1::GetModelRequest request;
      if (Parse(data, size, &request)) CheckModelId(request.model_id());
      break;
    }
  }
  return 0;
}
