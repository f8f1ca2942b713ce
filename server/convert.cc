#include "server/convert.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "runtime/config/loss_spec.h"

namespace tally {
namespace {

absl::Status BadEnum(const char* field, int value) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has unknown value ", value));
}

absl::StatusOr<LlamaConfig> ParseConfig(const v1::ModelConfig& c) {
  LlamaConfig config;
  config.vocab_size = c.vocab_size();
  config.hidden_size = c.hidden_size();
  config.intermediate_size = c.intermediate_size();
  config.num_hidden_layers = c.num_hidden_layers();
  config.num_attention_heads = c.num_attention_heads();
  config.num_key_value_heads = c.num_key_value_heads();
  config.rms_norm_eps = c.rms_norm_eps();
  config.rope_theta = c.rope_theta();
  config.max_position_embeddings = c.max_position_embeddings();
  config.tie_word_embeddings = c.tie_word_embeddings();
  config.num_local_experts = c.num_local_experts();
  config.num_experts_per_tok = c.num_experts_per_tok();
  config.router_aux_loss_coef = c.router_aux_loss_coef();
  config.output_router_logits = c.output_router_logits();
  config.model_type = c.model_type();
  config.head_dim = c.head_dim();
  config.attention_bias = c.attention_bias();
  config.mlp_bias = c.mlp_bias();
  config.rope_scaling.rope_type = c.rope_scaling().rope_type();
  if (config.rope_scaling.rope_type == "default") {
    config.rope_scaling.rope_type.clear();
  }
  config.rope_scaling.factor = c.rope_scaling().factor();
  config.rope_scaling.low_freq_factor = c.rope_scaling().low_freq_factor();
  config.rope_scaling.high_freq_factor = c.rope_scaling().high_freq_factor();
  config.rope_scaling.original_max_position_embeddings =
      c.rope_scaling().original_max_position_embeddings();
  config.sliding_window = c.sliding_window();
  config.max_window_layers = c.max_window_layers();
  config = config.WithDefaults();
  // The engine validates it too (see convert.h).
  TALLY_RETURN_IF_ERROR(config.Validate());
  return config;
}

AdamOverrides ParseAdam(const v1::AdamParams& p) {
  AdamOverrides o;
  if (p.has_learning_rate()) o.learning_rate = p.learning_rate();
  if (p.has_beta1()) o.beta1 = p.beta1();
  if (p.has_beta2()) o.beta2 = p.beta2();
  if (p.has_eps()) o.eps = p.eps();
  if (p.has_weight_decay()) o.weight_decay = p.weight_decay();
  return o;
}

}  // namespace

void ToProto(const LlamaConfig& c, v1::ModelConfig* out) {
  out->set_vocab_size(c.vocab_size);
  out->set_hidden_size(c.hidden_size);
  out->set_intermediate_size(c.intermediate_size);
  out->set_num_hidden_layers(c.num_hidden_layers);
  out->set_num_attention_heads(c.num_attention_heads);
  out->set_num_key_value_heads(c.num_key_value_heads);
  out->set_rms_norm_eps(c.rms_norm_eps);
  out->set_rope_theta(c.rope_theta);
  out->set_max_position_embeddings(c.max_position_embeddings);
  out->set_tie_word_embeddings(c.tie_word_embeddings);
  out->set_num_local_experts(c.num_local_experts);
  out->set_num_experts_per_tok(c.num_experts_per_tok);
  out->set_router_aux_loss_coef(c.router_aux_loss_coef);
  out->set_output_router_logits(c.output_router_logits);
  out->set_model_type(c.model_type);
  out->set_head_dim(c.head_dim);
  out->set_attention_bias(c.attention_bias);
  out->set_mlp_bias(c.mlp_bias);
  if (!c.rope_scaling.rope_type.empty()) {
    v1::RopeScaling* rope = out->mutable_rope_scaling();
    rope->set_rope_type(c.rope_scaling.rope_type);
    rope->set_factor(c.rope_scaling.factor);
    rope->set_low_freq_factor(c.rope_scaling.low_freq_factor);
    rope->set_high_freq_factor(c.rope_scaling.high_freq_factor);
    rope->set_original_max_position_embeddings(
        c.rope_scaling.original_max_position_embeddings);
  }
  out->set_sliding_window(c.sliding_window);
  out->set_max_window_layers(c.max_window_layers);
}

absl::Status ValidateModelId(const std::string& model_id,
                             const std::string& field) {
  if (model_id.empty() || model_id.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must have 1 to 128 characters, got ", model_id.size()));
  }
  // Ids name checkpoint directories (--checkpoint-dir/<id>).
  if (model_id == "." || model_id == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " may not be '", model_id, "'"));
  }
  for (char c : model_id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " may contain only [A-Za-z0-9._-], got '", model_id, "'"));
    }
  }
  return absl::OkStatus();
}

std::string ScopedModelId(const std::string& tenant,
                          const std::string& model_id) {
  return tenant.empty() ? model_id : absl::StrCat(tenant, "/", model_id);
}

std::string ClientModelId(const std::string& engine_id) {
  // Client ids have no '/', so only a scope puts one there.
  return engine_id.substr(engine_id.rfind('/') + 1);
}

bool InTenant(const std::string& engine_id, const std::string& tenant) {
  return tenant.empty() || absl::StartsWith(engine_id, tenant + "/");
}

std::string CreatedModelId(const v1::CreateModelRequest& request,
                           const v1::ModelInfo& response) {
  const std::string& requested = request.model_id();
  if (!requested.empty() && requested.back() != '/') return requested;
  return requested + response.model_id();
}

namespace {

// INVALID_ARGUMENT naming the lora field.
absl::StatusOr<LoraConfig> ParseLora(const v1::LoraConfig& r) {
  LoraConfig lora;
  lora.rank = r.rank();
  lora.alpha = r.alpha();
  lora.train_attn = !r.has_train_attn() || r.train_attn();
  lora.train_mlp = !r.has_train_mlp() || r.train_mlp();
  lora.train_unembed = !r.has_train_unembed() || r.train_unembed();
  if (r.has_seed()) lora.seed = r.seed();
  lora.init_adapter = r.init_adapter();
  if (!lora.init_adapter.empty()) {
    absl::Status path = ValidateCheckpointPath(lora.init_adapter);
    if (!path.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("lora.init_adapter: ", path.message()));
    }
  }
  lora = lora.WithDefaults();
  TALLY_RETURN_IF_ERROR(ValidateLoraConfig(lora));
  return lora;
}

}  // namespace

absl::StatusOr<ModelSpec> ParseCreateModel(const v1::CreateModelRequest& r) {
  ModelSpec spec;
  spec.model_id = r.model_id();
  spec.seed = r.seed();
  switch (r.dtype()) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_FLOAT32:
      spec.dtype = DType::kFloat32;
      break;
    case v1::DTYPE_FLOAT64:
      spec.dtype = DType::kFloat64;
      break;
    case v1::DTYPE_BFLOAT16:
      spec.dtype = DType::kBFloat16;
      break;
    case v1::DTYPE_FLOAT16:
      return absl::InvalidArgumentError(
          "dtype DTYPE_FLOAT16 is a storage dtype (ExportWeights.dtype); "
          "models train in DTYPE_FLOAT32, DTYPE_FLOAT64 or DTYPE_BFLOAT16 "
          "(mixed precision)");
    default:
      return BadEnum("dtype", r.dtype());
  }
  switch (r.optimizer()) {
    case v1::OPTIMIZER_UNSPECIFIED:
    case v1::OPTIMIZER_ADAMW:
      spec.optimizer = OptimizerKind::kAdamW;
      break;
    case v1::OPTIMIZER_SGD:
      spec.optimizer = OptimizerKind::kSgd;
      break;
    default:
      return BadEnum("optimizer", r.optimizer());
  }
  switch (r.grad_sync()) {
    case v1::GRAD_SYNC_UNSPECIFIED:
    case v1::GRAD_SYNC_EAGER:
      spec.grad_sync = GradSync::kEager;
      break;
    case v1::GRAD_SYNC_DEFERRED:
      spec.grad_sync = GradSync::kDeferred;
      break;
    default:
      return BadEnum("grad_sync", r.grad_sync());
  }
  const AdamOverrides adam = ParseAdam(r.default_adam());
  if (spec.optimizer == OptimizerKind::kSgd &&
      (adam.beta1 || adam.beta2 || adam.eps)) {
    return absl::InvalidArgumentError(
        "default_adam.beta1, beta2 and eps do not apply to the SGD optimizer");
  }
  spec.default_adam = adam.ResolveAgainst(AdamParams());
  spec.default_max_grad_norm = r.default_max_grad_norm();
  spec.activation_checkpointing = r.activation_checkpointing();
  spec.init_checkpoint = r.init_checkpoint();
  if (!spec.init_checkpoint.empty()) {
    TALLY_RETURN_IF_ERROR(ValidateCheckpointPath(spec.init_checkpoint));
  }
  if (r.has_lora()) {
    TALLY_ASSIGN_OR_RETURN(spec.lora, ParseLora(r.lora()));
  }
  if (r.has_config()) {
    // With init_checkpoint as well, the file's config.json must agree.
    TALLY_ASSIGN_OR_RETURN(spec.config, ParseConfig(r.config()));
  } else if (spec.init_checkpoint.empty()) {
    spec.config = LlamaConfig::EmbeddedDefault();
  }
  return spec;
}

namespace {

// The TokenLoss name of `loss_fn`: its enum name, lower case, without the
// prefix (LOSS_FN_PPO: "ppo").
absl::StatusOr<std::string> LossFnName(v1::LossFn loss_fn) {
  if (loss_fn == v1::LOSS_FN_UNSPECIFIED) return LossSpec().name;
  if (!v1::LossFn_IsValid(loss_fn)) return BadEnum("loss_fn", loss_fn);
  constexpr absl::string_view kPrefix = "LOSS_FN_";
  return absl::AsciiStrToLower(
      absl::string_view(v1::LossFn_Name(loss_fn)).substr(kPrefix.size()));
}

void ToProto(const PolicyStats& s, v1::PolicyStats* out) {
  out->set_tokens(s.tokens);
  out->set_ratio_mean(s.ratio_mean);
  out->set_ratio_min(s.ratio_min);
  out->set_ratio_max(s.ratio_max);
  out->set_clipped_fraction(s.clipped_fraction);
  out->set_logprob_gap_mean(s.logprob_gap_mean);
  out->set_logprob_gap_max(s.logprob_gap_max);
  out->set_kl_k1(s.kl_k1);
  out->set_kl_k3(s.kl_k3);
}

}  // namespace

absl::StatusOr<ForwardBackwardArgs> ParseForwardBackward(
    const v1::ForwardBackwardRequest& r) {
  ForwardBackwardArgs args;
  switch (r.reduction()) {
    case v1::LOSS_REDUCTION_UNSPECIFIED:
    case v1::LOSS_REDUCTION_TOKEN_MEAN:
      args.reduction = LossReduction::kTokenMean;
      break;
    case v1::LOSS_REDUCTION_SAMPLE_MEAN:
      args.reduction = LossReduction::kSampleMean;
      break;
    case v1::LOSS_REDUCTION_SUM:
      args.reduction = LossReduction::kSum;
      break;
    default:
      return BadEnum("reduction", r.reduction());
  }
  args.forward_only = r.forward_only();
  args.return_logprobs = r.return_logprobs();
  TALLY_ASSIGN_OR_RETURN(const std::string loss_name, LossFnName(r.loss_fn()));
  TALLY_ASSIGN_OR_RETURN(
      args.loss, ParseLossSpec(loss_name, std::map<std::string, double>(
                                              r.loss_fn_config().begin(),
                                              r.loss_fn_config().end())));
  args.samples.reserve(r.samples_size());
  for (const v1::Sample& s : r.samples()) {
    Sample sample;
    sample.input_tokens.assign(s.input_tokens().begin(),
                               s.input_tokens().end());
    sample.target_tokens.assign(s.target_tokens().begin(),
                                s.target_tokens().end());
    sample.weights.assign(s.weights().begin(), s.weights().end());
    for (const auto& [name, values] :
         {std::pair{kAdvantages, &s.advantages()},
          std::pair{kSamplingLogprobs, &s.sampling_logprobs()}}) {
      if (values->empty()) continue;
      sample.token_inputs[name].assign(values->begin(), values->end());
    }
    args.samples.push_back(std::move(sample));
  }
  // The engine refuses it too (see convert.h).
  if (args.samples.empty()) {
    return absl::InvalidArgumentError("samples must not be empty");
  }
  return args;
}

absl::StatusOr<OptimStepArgs> ParseOptimStep(const v1::OptimStepRequest& r) {
  OptimStepArgs args;
  args.adam = ParseAdam(r.adam());
  if (r.has_max_grad_norm()) {
    // Before the request is sequenced; the engine applies the same rule.
    TALLY_RETURN_IF_ERROR(
        ValidateMaxGradNorm(r.max_grad_norm(), "max_grad_norm"));
    args.max_grad_norm = r.max_grad_norm();
  }
  switch (r.norm_type()) {
    case v1::NORM_TYPE_UNSPECIFIED:
    case v1::NORM_TYPE_L2:
      args.norm_type = NormType::kL2;
      break;
    case v1::NORM_TYPE_INF:
      args.norm_type = NormType::kInf;
      break;
    default:
      return BadEnum("norm_type", r.norm_type());
  }
  switch (r.nonfinite()) {
    case v1::NON_FINITE_POLICY_UNSPECIFIED:
    case v1::NON_FINITE_POLICY_SKIP:
      args.nonfinite = NonFinitePolicy::kSkip;
      break;
    case v1::NON_FINITE_POLICY_ERROR:
      args.nonfinite = NonFinitePolicy::kError;
      break;
    default:
      return BadEnum("nonfinite", r.nonfinite());
  }
  return args;
}

namespace {

// Page tokens are versioned so a later encoding can tell them apart.
constexpr char kModelPageTokenPrefix[] = "v1:";

}  // namespace

absl::StatusOr<ModelPage> ParseListModels(const v1::ListModelsRequest& r) {
  if (r.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size must be >= 0, got ", r.page_size()));
  }
  ModelPage page;
  page.size = r.page_size() == 0 ? kDefaultModelPageSize
                                 : std::min(r.page_size(), kMaxModelPageSize);
  if (r.page_token().empty()) return page;
  std::string decoded;
  constexpr size_t kPrefixSize = sizeof(kModelPageTokenPrefix) - 1;
  if (!absl::WebSafeBase64Unescape(r.page_token(), &decoded) ||
      !absl::StartsWith(decoded, kModelPageTokenPrefix) ||
      decoded.size() == kPrefixSize) {
    return absl::InvalidArgumentError(
        "page_token is not a next_page_token of ListModels");
  }
  page.after = decoded.substr(kPrefixSize);
  return page;
}

std::string ModelPageToken(const std::string& last) {
  return absl::WebSafeBase64Escape(absl::StrCat(kModelPageTokenPrefix, last));
}

absl::Status ValidateCheckpointPath(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("path must not be empty");
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("path must not contain NUL bytes");
  }
  return absl::OkStatus();
}

absl::StatusOr<ExportOptions> ParseExportWeights(
    const v1::ExportWeightsRequest& r) {
  TALLY_RETURN_IF_ERROR(ValidateCheckpointPath(r.path()));
  ExportOptions options;
  options.merge = r.merge();
  switch (r.dtype()) {
    case v1::DTYPE_UNSPECIFIED:
      options.dtype = ExportDType::kModel;
      break;
    case v1::DTYPE_FLOAT32:
      options.dtype = ExportDType::kFloat32;
      break;
    case v1::DTYPE_FLOAT64:
      options.dtype = ExportDType::kFloat64;
      break;
    case v1::DTYPE_BFLOAT16:
      options.dtype = ExportDType::kBFloat16;
      break;
    case v1::DTYPE_FLOAT16:
      options.dtype = ExportDType::kFloat16;
      break;
    default:
      return BadEnum("dtype", r.dtype());
  }
  return options;
}

namespace {

std::vector<TokenIds> PromptsOf(
    const google::protobuf::RepeatedPtrField<v1::TokenSequence>& prompts) {
  std::vector<TokenIds> out;
  for (const v1::TokenSequence& prompt : prompts) {
    out.emplace_back(prompt.tokens().begin(), prompt.tokens().end());
  }
  return out;
}

}  // namespace

namespace {

// A Sample's or ComputeLogprobs' sampler: empty (the live weights) or a name.
absl::Status ValidateSamplerField(const std::string& sampler) {
  return sampler.empty() ? absl::OkStatus()
                         : ValidateSamplerName(sampler, "sampler");
}

}  // namespace

absl::StatusOr<SampleArgs> ParseSample(const v1::SampleRequest& r) {
  if (r.num_samples() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_samples must be >= 0 (0: 1), got ", r.num_samples()));
  }
  SampleArgs args;
  args.prompts = PromptsOf(r.prompts());
  args.num_samples = r.num_samples() == 0 ? 1 : r.num_samples();
  const v1::SamplingParams& params = r.params();
  args.max_tokens = params.max_tokens();
  if (params.has_temperature()) {
    args.sampling.temperature = params.temperature();
  }
  if (params.has_top_p()) args.sampling.top_p = params.top_p();
  if (params.has_top_k()) args.sampling.top_k = params.top_k();
  if (params.has_seed()) args.seed = params.seed();
  if (params.has_stop()) {
    StopConditions stop;
    stop.token_ids.assign(params.stop().token_ids().begin(),
                          params.stop().token_ids().end());
    stop.sequences = PromptsOf(params.stop().sequences());
    args.stop = std::move(stop);
  }
  args.include_prompt_logprobs = r.include_prompt_logprobs();
  args.topk_prompt_logprobs = r.topk_prompt_logprobs();
  TALLY_RETURN_IF_ERROR(ValidateSampleArgs(args));
  TALLY_RETURN_IF_ERROR(ValidateSamplerField(r.sampler()));
  return args;
}

absl::StatusOr<LogprobsArgs> ParseComputeLogprobs(
    const v1::ComputeLogprobsRequest& r) {
  LogprobsArgs args;
  args.prompts = PromptsOf(r.prompts());
  args.topk = r.topk();
  TALLY_RETURN_IF_ERROR(ValidateLogprobsArgs(args));
  TALLY_RETURN_IF_ERROR(ValidateSamplerField(r.sampler()));
  return args;
}

absl::Status ValidateSamplerRequest(
    const v1::SaveWeightsForSamplerRequest& request) {
  return ValidateSamplerName(request.name());
}

absl::Status ValidateSamplerRequest(const v1::DeleteSamplerRequest& request) {
  return ValidateSamplerName(request.name());
}

std::string SamplerPath(const std::string& client_model_id,
                        const std::string& name) {
  return absl::StrCat("tally://", client_model_id, "/samplers/", name);
}

void ToProto(const SamplerSummary& summary, v1::SamplerInfo* out) {
  out->set_model_id(ClientModelId(summary.model_id));
  out->set_name(summary.name);
  out->set_step(summary.step);
  out->set_bytes(summary.bytes);
  out->set_created_unix_micros(absl::ToUnixMicros(summary.created));
  out->set_is_adapter(summary.is_adapter);
  out->set_path(SamplerPath(out->model_id(), summary.name));
}

int64_t SampleTokenBound(const v1::SampleRequest& r) {
  // In double: the product of a hostile request's int32 fields overflows.
  const double samples = std::max(1, r.num_samples());
  const double generated = std::max(0, r.params().max_tokens());
  double tokens = 0;
  for (const v1::TokenSequence& prompt : r.prompts()) {
    tokens += samples * (prompt.tokens_size() + generated);
  }
  constexpr double kMax = 9e18;  // below INT64_MAX
  return static_cast<int64_t>(std::min(tokens, kMax));
}

v1::LossReduction ToProto(std::optional<LossReduction> reduction) {
  if (!reduction) return v1::LOSS_REDUCTION_UNSPECIFIED;
  switch (*reduction) {
    case LossReduction::kTokenMean:
      return v1::LOSS_REDUCTION_TOKEN_MEAN;
    case LossReduction::kSampleMean:
      return v1::LOSS_REDUCTION_SAMPLE_MEAN;
    case LossReduction::kSum:
      return v1::LOSS_REDUCTION_SUM;
  }
  return v1::LOSS_REDUCTION_UNSPECIFIED;
}

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return v1::DTYPE_FLOAT64;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kFloat32:
      break;
  }
  return v1::DTYPE_FLOAT32;
}

void ToProto(const ModelSummary& s, v1::ModelInfo* out) {
  out->set_model_id(ClientModelId(s.model_id));
  ToProto(s.config, out->mutable_config());
  out->set_num_parameters(s.num_parameters);
  out->set_step(s.step);
  out->set_accumulated_calls(s.window.calls);
  out->set_accumulated_tokens(s.window.tokens);
  out->set_accumulated_samples(s.window.samples);
  out->set_pending_reduction(ToProto(s.window.reduction));
  out->set_dtype(ToProto(s.dtype));
  out->set_optimizer(s.optimizer == OptimizerKind::kSgd ? v1::OPTIMIZER_SGD
                                                        : v1::OPTIMIZER_ADAMW);
  v1::AdamParams* adam = out->mutable_default_adam();
  adam->set_learning_rate(s.default_adam.learning_rate);
  adam->set_beta1(s.default_adam.beta1);
  adam->set_beta2(s.default_adam.beta2);
  adam->set_eps(s.default_adam.eps);
  adam->set_weight_decay(s.default_adam.weight_decay);
  out->set_default_max_grad_norm(s.default_max_grad_norm);
  out->set_grad_sync(s.grad_sync == GradSync::kDeferred ? v1::GRAD_SYNC_DEFERRED
                                                        : v1::GRAD_SYNC_EAGER);
  out->set_activation_checkpointing(s.activation_checkpointing);
  if (s.lora.enabled()) {
    v1::LoraConfig* lora = out->mutable_lora();
    lora->set_rank(static_cast<int32_t>(s.lora.rank));
    lora->set_alpha(s.lora.alpha);
    lora->set_train_attn(s.lora.train_attn);
    lora->set_train_mlp(s.lora.train_mlp);
    lora->set_train_unembed(s.lora.train_unembed);
    if (s.lora.seed) lora->set_seed(*s.lora.seed);
    lora->set_init_adapter(s.lora.init_adapter);
  }
  out->set_base(s.base);
  out->set_trainable_parameters(s.trainable_parameters);
  out->set_trainable_bytes(s.trainable_bytes);
  out->set_damage(s.damage);
  for (int64_t id : s.eos_token_ids) {
    out->add_eos_token_ids(static_cast<int32_t>(id));
  }
}

int64_t ForwardBackwardResponseBound(const v1::ForwardBackwardRequest& request,
                                     int64_t num_experts) {
  // Wire sizes: a tag is 1 byte here, a varint at most 10, a double 8, a
  // length prefix at most 5.
  constexpr int64_t kScalar = 1 + 10;
  constexpr int64_t kNested = 1 + 5;
  // Metrics: the engine's micro_batches, padded_tokens and seconds, and
  // per MoE model the tokens of each expert and the load min and max; each
  // entry a map message of a key of at most 32 bytes and a double.
  constexpr int64_t kMetricEntry = kNested + (1 + 1 + 32) + (1 + 8);
  const int64_t metrics = 3 + (num_experts > 0 ? num_experts + 2 : 0);
  // PolicyStats: 8 doubles and a count.
  constexpr int64_t kPolicy = kNested + 9 * kScalar;
  int64_t bound = 8 * kScalar + metrics * kMetricEntry + kPolicy;
  for (const v1::Sample& sample : request.samples()) {
    bound += kNested + 2 * kScalar + kPolicy;
    if (request.return_logprobs()) {
      // logprobs and token_losses.
      bound +=
          2 * (kNested + 8 * static_cast<int64_t>(sample.input_tokens_size()));
    }
  }
  return bound;
}

void ToProto(const ForwardBackwardResult& r, v1::ForwardBackwardResponse* out) {
  out->set_loss_sum(r.loss_sum);
  out->set_loss_mean(r.loss_mean);
  out->set_valid_tokens(r.valid_tokens);
  out->set_num_samples(r.num_samples);
  for (const SampleResult& s : r.samples) {
    v1::SampleResult* sample = out->add_samples();
    sample->set_loss_sum(s.loss_sum);
    sample->set_valid_tokens(s.valid_tokens);
    sample->mutable_logprobs()->Add(s.logprobs.begin(), s.logprobs.end());
    sample->mutable_token_losses()->Add(s.token_losses.begin(),
                                        s.token_losses.end());
    if (s.policy) ToProto(*s.policy, sample->mutable_policy());
  }
  if (r.policy) ToProto(*r.policy, out->mutable_policy());
  out->set_accumulated_calls(r.window.calls);
  out->set_accumulated_tokens(r.window.tokens);
  out->set_accumulated_samples(r.window.samples);
  for (const auto& [k, v] : r.metrics) (*out->mutable_metrics())[k] = v;
}

void ToProto(const OptimStepResult& r, v1::OptimStepResponse* out) {
  out->set_step(r.step);
  out->set_grad_norm(r.grad_norm);
  out->set_clip_coef(r.clip_coef);
  out->set_normalizer(r.normalizer);
  out->set_skipped(r.skipped);
  out->set_skip_reason(r.skip_reason);
  out->set_learning_rate(r.learning_rate);
  for (const auto& [k, v] : r.metrics) (*out->mutable_metrics())[k] = v;
}

}  // namespace tally
