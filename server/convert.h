// Conversion and validation between tally.v1 messages and runtime types.
//
// Every Parse* function checks what only the request shows (enum values a
// newer or hostile client may send, which fields are set, NUL bytes in
// paths) and returns INVALID_ARGUMENT naming the field; it never touches
// state. Value ranges are the engine's (the library boundary); three of its
// rules also run here, through the same functions (LlamaConfig::Validate,
// ValidateMaxGradNorm) or the same one-line rule (samples not empty), on the
// gRPC thread, so such a request neither takes a seq_id nor reaches the
// other ranks. The model id is
// checked separately with ValidateModelId, on the id the client sent: the
// server may scope it to a tenant ("<tenant>/<id>", an engine id) before the
// command runs. The front end parses a request once, before admission, and
// the command runs on what it parsed (commands.h). Checks that need the model
// (token ranges, lengths) are the engine's, also done before any state changes.
//
//   TALLY_ASSIGN_OR_RETURN(tally::OptimStepArgs args,
//                          tally::ParseOptimStep(request));
//   tally::ToProto(engine_result, &response);
#ifndef TALLY_SERVER_CONVERT_H_
#define TALLY_SERVER_CONVERT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/checkpoint/weights_export.h"
#include "runtime/config/sampler_name.h"
#include "runtime/config/sampling_params.h"
#include "runtime/config/types.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

// `[A-Za-z0-9._-]{1,128}` except "." and ".." (ids name directories);
// `field` names the request field in the error.
absl::Status ValidateModelId(const std::string& model_id,
                             const std::string& field = "model_id");

// Tenancy: a tenant's models live in the engine as "<tenant>/<model_id>", so
// tenants never see (or collide with) each other's ids. An empty tenant (no
// authentication) leaves ids as they are.
std::string ScopedModelId(const std::string& tenant,
                          const std::string& model_id);
// The id a client knows: the engine id without its tenant scope.
std::string ClientModelId(const std::string& engine_id);
// True when `engine_id` belongs to `tenant` (always, for tenant "").
bool InTenant(const std::string& engine_id, const std::string& tenant);
// The engine id of the model that `request` (with an engine id) created and
// `response` describes: the engine picks one when the request gives none or
// a tenant scope alone ("<tenant>/").
std::string CreatedModelId(const v1::CreateModelRequest& request,
                           const v1::ModelInfo& response);

absl::StatusOr<ModelSpec> ParseCreateModel(
    const v1::CreateModelRequest& request);
absl::StatusOr<ForwardBackwardArgs> ParseForwardBackward(
    const v1::ForwardBackwardRequest& request);
absl::StatusOr<OptimStepArgs> ParseOptimStep(
    const v1::OptimStepRequest& request);
// Non-empty path with no NUL byte.
absl::Status ValidateCheckpointPath(const std::string& path);
// The path (ValidateCheckpointPath) and the dtype, any of them
// (DTYPE_UNSPECIFIED: the model's); max_shard_bytes stays the default.
absl::StatusOr<ExportOptions> ParseExportWeights(
    const v1::ExportWeightsRequest& request);

// The call's arguments (runtime/config/sampling_params.h), checked with
// ValidateSampleArgs / ValidateLogprobsArgs: INVALID_ARGUMENT naming the
// field (prompts[i].tokens[j], num_samples, params.max_tokens,
// params.top_p, ...). num_samples 0 means 1; params.stop absent: the
// model's EOS tokens. Token ranges are the engine's.
absl::StatusOr<SampleArgs> ParseSample(const v1::SampleRequest& request);
absl::StatusOr<LogprobsArgs> ParseComputeLogprobs(
    const v1::ComputeLogprobsRequest& request);
// Both also check `sampler` when set (ValidateSamplerName), naming it.
// SaveWeightsForSampler's and DeleteSampler's name (ValidateSamplerName,
// runtime/config/sampler_name.h): INVALID_ARGUMENT naming `name`.
absl::Status ValidateSamplerRequest(
    const v1::SaveWeightsForSamplerRequest& request);
absl::Status ValidateSamplerRequest(const v1::DeleteSamplerRequest& request);
// The handle of a sampler snapshot that Tinker-shaped clients pass as a
// model_path: "tally://<client model id>/samplers/<name>".
std::string SamplerPath(const std::string& client_model_id,
                        const std::string& name);
// The tokens a Sample may hold at once: prompts x num_samples x
// (prompt + max_tokens), what --max-tokens-per-call bounds.
int64_t SampleTokenBound(const v1::SampleRequest& request);

// One page of ListModels: at most `size` models whose engine id sorts after
// `after` (empty: from the first).
struct ModelPage {
  int size = 0;
  std::string after;
};
inline constexpr int kDefaultModelPageSize = 100;
inline constexpr int kMaxModelPageSize = 1000;
// INVALID_ARGUMENT naming page_size (negative) or page_token (not one this
// server issued).
absl::StatusOr<ModelPage> ParseListModels(const v1::ListModelsRequest& request);
// The opaque token of the page after the model with engine id `last`.
std::string ModelPageToken(const std::string& last);

// An upper bound of the serialized ForwardBackwardResponse to `request`
// for a model with `num_experts` experts per layer (0: dense): known before
// the call runs, so a response over the message limit is refused before it
// changes anything.
int64_t ForwardBackwardResponseBound(const v1::ForwardBackwardRequest& request,
                                     int64_t num_experts);

// model_id is the client's (ClientModelId).
void ToProto(const ModelSummary& summary, v1::ModelInfo* out);
void ToProto(const LlamaConfig& config, v1::ModelConfig* out);
v1::DType ToProto(DType dtype);
void ToProto(const ForwardBackwardResult& result,
             v1::ForwardBackwardResponse* out);
void ToProto(const OptimStepResult& result, v1::OptimStepResponse* out);
v1::LossReduction ToProto(std::optional<LossReduction> reduction);
// model_id is the client's, path SamplerPath's.
void ToProto(const SamplerSummary& summary, v1::SamplerInfo* out);

}  // namespace tally

#endif  // TALLY_SERVER_CONVERT_H_
