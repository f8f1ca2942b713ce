// tally-server's flags are absl flags named in snake_case (absl names cannot
// hold '-'): `--grpc-port` on the command line is FLAGS_grpc_port here.
// ParseServerFlags maps the kebab-case names through the kSections table
// (the flags tally-server accepts, their value names and --help sections),
// lets absl parse the typed values, and ServerOptionsFromFlags applies the
// ranges and turns the flags into ServerOptions.
#include "server/flags.h"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/log.h"
#include "base/status.h"

namespace tally {
namespace {

// The flags' defaults are ServerOptions' (server/server.h).
const ServerOptions& Defaults() {
  static const ServerOptions* const defaults = new ServerOptions();
  return *defaults;
}

}  // namespace
}  // namespace tally

// ABSL_FLAG must be used at global scope. Help texts are shown by --help,
// followed by the default.

// Serving.
ABSL_FLAG(std::string, host, tally::Defaults().host,
          "address to listen on (gRPC and metrics)");
ABSL_FLAG(int64_t, grpc_port, tally::Defaults().grpc_port,
          "gRPC port (local rank r: N + r); 0 picks a free one");
ABSL_FLAG(std::string, port_file, tally::Defaults().port_file,
          "write {\"grpc_port\": N, \"metrics_port\": M} here once serving");
ABSL_FLAG(int64_t, max_message_bytes, tally::Defaults().max_message_bytes,
          "largest gRPC message accepted or sent");
ABSL_FLAG(bool, demo_model, tally::Defaults().demo_model,
          "create model 'demo' (the embedded default Llama) at start");

// Mesh and parallelism.
ABSL_FLAG(int64_t, nproc_per_node, tally::Defaults().nproc_per_node,
          "launch and supervise N local rank processes (like torchrun)");
ABSL_FLAG(int64_t, dp_replicate, tally::Defaults().mesh.dp_replicate,
          "data-parallel replicas (gradients all-reduced)");
ABSL_FLAG(int64_t, dp_shard, tally::Defaults().mesh.dp_shard,
          "ZeRO-3 / FSDP parameter shards");
ABSL_FLAG(int64_t, cp, tally::Defaults().mesh.cp,
          "context-parallel ranks (each sample's tokens split over them)");
ABSL_FLAG(int64_t, ep, tally::Defaults().mesh.ep,
          "expert-parallel ranks, carved out of dp-shard x cp (MoE models)");
ABSL_FLAG(int64_t, pp, tally::Defaults().mesh.pp,
          "pipeline stages (contiguous runs of decoder layers, 1F1B schedule)");
// Unset: ServerOptions' 0, which means --pp.
ABSL_FLAG(std::optional<int64_t>, pp_microbatches, std::nullopt,
          "micro-batches each call is cut into under --pp (none: as many as "
          "--pp)");
ABSL_FLAG(int64_t, tp, tally::Defaults().mesh.tp,
          "Megatron tensor-parallel ranks");
// Unset overrides leave the environment in charge.
ABSL_FLAG(std::optional<int64_t>, rank, std::nullopt,
          "this process's rank (overrides RANK / LWS_WORKER_INDEX)");
ABSL_FLAG(std::optional<int64_t>, world_size, std::nullopt,
          "ranks in the world (overrides WORLD_SIZE)");
ABSL_FLAG(std::optional<std::string>, master_addr, std::nullopt,
          "rank 0's address (overrides MASTER_ADDR)");
ABSL_FLAG(std::optional<int64_t>, master_port, std::nullopt,
          "rendezvous port on rank 0 (overrides MASTER_PORT)");
ABSL_FLAG(int64_t, rendezvous_timeout_secs,
          static_cast<int64_t>(tally::Defaults().rendezvous_timeout_secs),
          "how long ranks retry reaching rank 0 (DNS may lag in Kubernetes)");

// Training.
ABSL_FLAG(int64_t, max_batch_tokens, tally::Defaults().max_batch_tokens,
          "padded tokens per forward/backward micro-batch (memory bound)");
ABSL_FLAG(int64_t, bucket_mb, tally::Defaults().bucket_mb,
          "MiB per flat bucket of the gradient all-reduce over replicas");
ABSL_FLAG(int64_t, threads, tally::Defaults().threads,
          "intra-op threads of this rank (LibTorch and the BLAS); 0: "
          "OMP_NUM_THREADS if set, else the cores this process may use "
          "divided by the ranks on the machine (LOCAL_WORLD_SIZE)");
ABSL_FLAG(bool, overlap_grad_sync, tally::Defaults().overlap_grad_sync,
          "EAGER: sum gradient buckets during backward (=false: after it)");
ABSL_FLAG(std::string, attention,
          tally::AttentionModeName(tally::Defaults().attention.mode),
          "auto (blocked past 2048 keys per row), materialized or blocked: "
          "blocked attention's extra memory is O(T x block) per head, the "
          "materialized one's O(T^2); same results to rounding");
ABSL_FLAG(int64_t, attention_block_keys, tally::Defaults().attention.block_keys,
          "keys per block of blocked attention");
ABSL_FLAG(std::string, device, tally::DeviceKindName(tally::Defaults().device),
          "auto (cuda when a GPU is usable, else cpu), cpu or cuda: local "
          "rank r computes on GPU r of those visible (CUDA_VISIBLE_DEVICES); "
          "fewer GPUs than local ranks is refused");
ABSL_FLAG(bool, allow_tf32, tally::Defaults().allow_tf32,
          "let float32 matmuls and convolutions on a GPU round through TF32 "
          "(faster, ~1e-3 relative); off: exact float32");
ABSL_FLAG(int64_t, zero_stage,
          static_cast<int64_t>(tally::Defaults().zero_stage),
          "what --dp-shard shards: 3 parameters, gradients and optimizer "
          "state (FSDP; an all-gather and a reduce-scatter per pass); 2 "
          "gradients and optimizer state (parameters kept gathered, one "
          "all-gather per step); 1 optimizer state (whole gradients too, "
          "one reduce-scatter per sync)");

// Checkpoints (docs/checkpoints.md).
ABSL_FLAG(std::string, checkpoint_root, tally::Defaults().checkpoint_root,
          "client checkpoint paths must lie inside DIR (relative: under it)");
ABSL_FLAG(std::string, models_root, tally::Defaults().models_root,
          "CreateModel init_checkpoint names such as Org/Name resolve in DIR "
          "(HF hub cache layout or Org/Name folders)");
ABSL_FLAG(std::string, checkpoint_dir, tally::Defaults().checkpoint_dir,
          "periodic checkpoints and --resume: DIR/<model>/step-<N>/");
ABSL_FLAG(int64_t, checkpoint_every_steps,
          tally::Defaults().checkpoint_every_steps,
          "checkpoint a model into --checkpoint-dir every N optimizer steps");
ABSL_FLAG(int64_t, checkpoint_keep, tally::Defaults().checkpoint_keep,
          "periodic checkpoints kept per model (newest)");
ABSL_FLAG(bool, resume, tally::Defaults().resume,
          "at start, load each model's newest valid checkpoint in "
          "--checkpoint-dir");
ABSL_FLAG(bool, checkpoint_on_exit, tally::Defaults().checkpoint_on_exit,
          "on SIGTERM/SIGINT, after the last request, checkpoint every model "
          "into --checkpoint-dir (a pending window's gradients are dropped)");

// Reliability and limits (docs/reliability.md).
ABSL_FLAG(double, seq_gap_timeout_secs, tally::Defaults().seq_gap_timeout_secs,
          "how long a missing seq_id may hold back the requests behind it "
          "(then ABORTED, window poisoned)");
ABSL_FLAG(int64_t, seq_cache, tally::Defaults().seq_cache,
          "responses kept per model for retried sequenced requests");
ABSL_FLAG(int64_t, max_queued_requests, tally::Defaults().max_queued_requests,
          "requests held at once (waiting, queued, executing); beyond: "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_queued_requests_per_model,
          tally::Defaults().max_queued_requests_per_model,
          "requests held at once for one model");
ABSL_FLAG(int64_t, max_queued_requests_per_tenant,
          tally::Defaults().max_queued_requests_per_tenant,
          "requests held at once for one authenticated tenant");
ABSL_FLAG(int64_t, max_memory_bytes, tally::Defaults().max_memory_bytes,
          "memory admission: bytes this rank's models and a call's "
          "activations may take, by estimate (0: 80% of the machine's or "
          "cgroup's memory / local ranks)");
ABSL_FLAG(int64_t, max_memory_bytes_per_tenant,
          tally::Defaults().max_memory_bytes_per_tenant,
          "memory admission per authenticated tenant (0: no quota)");
ABSL_FLAG(int64_t, max_tokens_per_call, tally::Defaults().max_tokens_per_call,
          "tokens of one ForwardBackward, all samples together");
ABSL_FLAG(double, shutdown_drain_secs, tally::Defaults().shutdown_drain_secs,
          "on SIGTERM/SIGINT, keep serving this long while NOT_SERVING");
ABSL_FLAG(double, exit_timeout_secs, tally::Defaults().exit_timeout_secs,
          "on SIGTERM/SIGINT, exit within this (drain included; 1 if overrun)");
ABSL_FLAG(double, collective_timeout_secs,
          tally::Defaults().collective_timeout_secs,
          "a collective waiting longer on a dead or hung rank fails; the "
          "server then exits non-zero");

// Security (docs/security.md).
ABSL_FLAG(std::string, tls_cert, tally::Defaults().tls_cert,
          "serve TLS with this certificate chain");
ABSL_FLAG(std::string, tls_key, tally::Defaults().tls_key,
          "private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, tally::Defaults().tls_client_ca,
          "require client certificates signed by this CA (mutual TLS)");
ABSL_FLAG(std::string, auth_tokens_file, tally::Defaults().auth_tokens_file,
          "require 'authorization: Bearer <token>'; lines '<token> <tenant>'");
ABSL_FLAG(std::string, metrics_auth_file, tally::Defaults().metrics_auth_file,
          "require HTTP Basic auth on /metrics; one line '<user>:<password>' "
          "(needed with --auth-tokens-file on a non-loopback --host)");
ABSL_FLAG(bool, allow_insecure_remote, tally::Defaults().allow_insecure_remote,
          "allow a non-loopback --host without TLS");

// Metrics and logging.
ABSL_FLAG(int64_t, metrics_port, tally::Defaults().metrics_port,
          "Prometheus /metrics port (local rank r: N + r); 0 picks a free one");
ABSL_FLAG(std::string, log_level, tally::Defaults().log_level,
          "debug, info, warning or error");
ABSL_FLAG(std::string, log_format, tally::Defaults().log_format,
          "text, or json: one object per line with time, level, rank, model, "
          "request_id and message");

namespace tally {
namespace {

struct FlagDoc {
  const char* name;        // kebab-case, as on the command line
  const char* value_name;  // nullptr for booleans
};

struct FlagSection {
  const char* title;  // capitalized (tests/deploy/server_flags.py)
  std::vector<FlagDoc> flags;
};

// The flags tally-server accepts, in --help order. Every ABSL_FLAG above is
// here once (server/server_flags_test.cc checks).
const std::vector<FlagSection>& Sections() {
  static const auto* const sections = new std::vector<FlagSection>{
      {"Serving",
       {{"host", "ADDR"},
        {"grpc-port", "N"},
        {"port-file", "PATH"},
        {"max-message-bytes", "N"},
        {"demo-model", nullptr}}},
      {"Mesh and parallelism",
       {{"nproc-per-node", "N"},
        {"dp-replicate", "N"},
        {"dp-shard", "N"},
        {"cp", "N"},
        {"ep", "N"},
        {"pp", "N"},
        {"pp-microbatches", "N"},
        {"tp", "N"},
        {"rank", "R"},
        {"world-size", "N"},
        {"master-addr", "HOST"},
        {"master-port", "N"},
        {"rendezvous-timeout-secs", "S"}}},
      {"Training",
       {{"max-batch-tokens", "N"},
        {"threads", "N"},
        {"bucket-mb", "N"},
        {"overlap-grad-sync", nullptr},
        {"attention", "MODE"},
        {"attention-block-keys", "N"},
        {"zero-stage", "N"},
        {"device", "KIND"},
        {"allow-tf32", nullptr}}},
      {"Checkpoints",
       {{"checkpoint-root", "DIR"},
        {"models-root", "DIR"},
        {"checkpoint-dir", "DIR"},
        {"checkpoint-every-steps", "N"},
        {"checkpoint-keep", "K"},
        {"resume", nullptr},
        {"checkpoint-on-exit", nullptr}}},
      {"Reliability and limits",
       {{"seq-gap-timeout-secs", "S"},
        {"seq-cache", "N"},
        {"max-queued-requests", "N"},
        {"max-queued-requests-per-model", "N"},
        {"max-queued-requests-per-tenant", "N"},
        {"max-memory-bytes", "N"},
        {"max-memory-bytes-per-tenant", "N"},
        {"max-tokens-per-call", "N"},
        {"shutdown-drain-secs", "S"},
        {"exit-timeout-secs", "S"},
        {"collective-timeout-secs", "S"}}},
      {"Security",
       {{"tls-cert", "PEM"},
        {"tls-key", "PEM"},
        {"tls-client-ca", "PEM"},
        {"auth-tokens-file", "PATH"},
        {"metrics-auth-file", "PATH"},
        {"allow-insecure-remote", nullptr}}},
      {"Metrics and logging",
       {{"metrics-port", "N"},
        {"log-level", "LEVEL"},
        {"log-format", "FORMAT"}}},
  };
  return *sections;
}

// "grpc-port" <-> "grpc_port".
std::string AbslName(absl::string_view kebab) {
  return absl::StrReplaceAll(kebab, {{"-", "_"}});
}
std::string KebabName(absl::string_view absl_name) {
  return absl::StrReplaceAll(absl_name, {{"_", "-"}});
}

// nullptr unless `kebab` names a flag of Sections().
absl::CommandLineFlag* FindServerFlag(absl::string_view kebab) {
  for (const FlagSection& section : Sections()) {
    for (const FlagDoc& doc : section.flags) {
      if (doc.name == kebab) return absl::FindCommandLineFlag(AbslName(kebab));
    }
  }
  return nullptr;
}

// ---------------------------------------------------------------------------
// Command line -> absl flags.

absl::Status ResetFlagsToDefaults() {
  for (const FlagSection& section : Sections()) {
    for (const FlagDoc& doc : section.flags) {
      absl::CommandLineFlag* flag =
          absl::FindCommandLineFlag(AbslName(doc.name));
      std::string error;
      if (flag == nullptr || !flag->ParseFrom(flag->DefaultValue(), &error)) {
        return absl::InternalError(
            absl::StrCat("cannot reset --", doc.name, ": ", error));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status BadValue(absl::string_view flag, absl::string_view value,
                      absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": expected ", expected, ", got '", value, "'"));
}

// Parses `value` into `flag` (named `name` on the command line).
absl::Status SetFlagValue(absl::CommandLineFlag& flag, absl::string_view name,
                          absl::string_view value) {
  // absl also reads 1/0, yes/no, t/f; tally-server's contract is true/false.
  if (flag.IsOfType<bool>() && value != "true" && value != "false") {
    return BadValue(name, value, "true or false");
  }
  // absl reads "" as unset for optional flags; leaving the flag out does that.
  if (value.empty() && (flag.IsOfType<std::optional<int64_t>>() ||
                        flag.IsOfType<std::optional<std::string>>())) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " needs a value"));
  }
  std::string error;
  if (flag.ParseFrom(value, &error)) return absl::OkStatus();
  // absl names the flag 'grpc_port'; the user typed --grpc-port.
  std::string message = absl::StrReplaceAll(
      error,
      {{absl::StrCat("'", flag.Name(), "'"), absl::StrCat("'--", name, "'")}});
  if (!absl::StrContains(message, absl::StrCat("--", name))) {
    message = absl::StrCat("--", name, ": ", message);
  }
  return absl::InvalidArgumentError(message);
}

// argv[*i] is a flag; a valued flag without `=` takes argv[*i + 1] and
// advances *i past it.
absl::Status ParseFlagArgument(int argc, const char* const* argv, int* i) {
  const absl::string_view arg = argv[*i];
  if (!absl::StartsWith(arg, "--")) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument '", arg, "' (see --help)"));
  }
  absl::string_view name = arg.substr(2);
  std::optional<absl::string_view> value;
  if (size_t eq = name.find('='); eq != absl::string_view::npos) {
    value = name.substr(eq + 1);
    name = name.substr(0, eq);
  }
  absl::CommandLineFlag* flag = FindServerFlag(name);
  if (flag == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown flag --", name, " (see --help)"));
  }
  if (!value.has_value()) {
    if (flag->IsOfType<bool>()) {
      value = "true";
    } else if (*i + 1 < argc) {
      value = argv[++*i];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " needs a value"));
    }
  }
  return SetFlagValue(*flag, name, *value);
}

// ---------------------------------------------------------------------------
// absl flags -> ServerOptions: the ranges and what the flags mean.

template <typename T>
void Assign(int64_t value, T* out) {
  *out = static_cast<T>(value);
}
template <typename T>
void Assign(int64_t value, std::optional<T>* out) {
  *out = static_cast<T>(value);
}

template <typename T>
absl::Status SetInt(const absl::Flag<int64_t>& flag, int64_t min, int64_t max,
                    T* out) {
  const int64_t value = absl::GetFlag(flag);
  if (value < min || value > max) {
    return BadValue(KebabName(absl::GetFlagReflectionHandle(flag).Name()),
                    absl::StrCat(value),
                    absl::StrCat("an integer in [", min, ", ", max, "]"));
  }
  Assign(value, out);
  return absl::OkStatus();
}

// Unset: `out` keeps its default.
template <typename T>
absl::Status SetInt(const absl::Flag<std::optional<int64_t>>& flag, int64_t min,
                    int64_t max, T* out) {
  const std::optional<int64_t> value = absl::GetFlag(flag);
  if (!value.has_value()) return absl::OkStatus();
  if (*value < min || *value > max) {
    return BadValue(KebabName(absl::GetFlagReflectionHandle(flag).Name()),
                    absl::StrCat(*value),
                    absl::StrCat("an integer in [", min, ", ", max, "]"));
  }
  Assign(*value, out);
  return absl::OkStatus();
}

absl::Status SetSeconds(const absl::Flag<double>& flag, double min, double max,
                        double* out) {
  const double value = absl::GetFlag(flag);
  if (!(value >= min && value <= max)) {  // NaN too
    return BadValue(KebabName(absl::GetFlagReflectionHandle(flag).Name()),
                    absl::StrCat(value),
                    absl::StrCat("seconds in [", min, ", ", max, "]"));
  }
  *out = value;
  return absl::OkStatus();
}

absl::Status SetServingOptions(ServerOptions& o) {
  o.host = absl::GetFlag(FLAGS_host);
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_grpc_port, 0, 65535, &o.grpc_port));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_metrics_port, 0, 65535, &o.metrics_port));
  o.port_file = absl::GetFlag(FLAGS_port_file);
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_max_message_bytes, 1024,
                               (int64_t{1} << 31) - 1, &o.max_message_bytes));
  o.demo_model = absl::GetFlag(FLAGS_demo_model);
  o.log_level = absl::GetFlag(FLAGS_log_level);
  if (!ParseLogLevel(o.log_level).ok()) {
    return BadValue("log-level", o.log_level, "debug, info, warning or error");
  }
  o.log_format = absl::GetFlag(FLAGS_log_format);
  if (!ParseLogFormat(o.log_format).ok()) {
    return BadValue("log-format", o.log_format, "text or json");
  }
  return absl::OkStatus();
}

absl::Status SetMeshOptions(ServerOptions& o) {
  TALLY_RETURN_IF_ERROR(
      SetInt(FLAGS_nproc_per_node, 1, 1024, &o.nproc_per_node));
  TALLY_RETURN_IF_ERROR(
      SetInt(FLAGS_dp_replicate, 1, 1024, &o.mesh.dp_replicate));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_dp_shard, 1, 1024, &o.mesh.dp_shard));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_cp, 1, 1024, &o.mesh.cp));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_ep, 1, 1024, &o.mesh.ep));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_pp, 1, 1024, &o.mesh.pp));
  TALLY_RETURN_IF_ERROR(
      SetInt(FLAGS_pp_microbatches, 1, 1 << 20, &o.pp_microbatches));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_tp, 1, 1024, &o.mesh.tp));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_rank, 0, 1 << 20, &o.rank_env.rank));
  TALLY_RETURN_IF_ERROR(
      SetInt(FLAGS_world_size, 1, 1 << 20, &o.rank_env.world_size));
  o.rank_env.master_addr = absl::GetFlag(FLAGS_master_addr);
  TALLY_RETURN_IF_ERROR(
      SetInt(FLAGS_master_port, 1, 65535, &o.rank_env.master_port));
  return SetInt(FLAGS_rendezvous_timeout_secs, 1, 86400,
                &o.rendezvous_timeout_secs);
}

absl::Status SetTrainingOptions(ServerOptions& o) {
  TALLY_RETURN_IF_ERROR(
      SetInt(FLAGS_max_batch_tokens, 1, int64_t{1} << 30, &o.max_batch_tokens));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_threads, 0, 1024, &o.threads));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_bucket_mb, 1, 1 << 16, &o.bucket_mb));
  o.overlap_grad_sync = absl::GetFlag(FLAGS_overlap_grad_sync);
  const std::string attention = absl::GetFlag(FLAGS_attention);
  const std::optional<AttentionMode> mode = AttentionModeNamed(attention);
  if (!mode) {
    return BadValue("attention", attention, "auto, materialized or blocked");
  }
  o.attention.mode = *mode;
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_attention_block_keys, 1, int64_t{1} << 20,
                               &o.attention.block_keys));
  int64_t zero_stage = 0;
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_zero_stage, 1, 3, &zero_stage));
  o.zero_stage = *ZeroStageNumbered(zero_stage);
  TALLY_ASSIGN_OR_RETURN(o.device,
                         ParseDeviceKind(absl::GetFlag(FLAGS_device)));
  o.allow_tf32 = absl::GetFlag(FLAGS_allow_tf32);
  return absl::OkStatus();
}

absl::Status SetCheckpointOptions(ServerOptions& o) {
  o.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  o.models_root = absl::GetFlag(FLAGS_models_root);
  std::error_code models_root_error;
  if (!o.models_root.empty() &&
      !std::filesystem::is_directory(o.models_root, models_root_error)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--models-root ", o.models_root, " is not a directory"));
  }
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_checkpoint_every_steps, 0,
                               int64_t{1} << 40, &o.checkpoint_every_steps));
  TALLY_RETURN_IF_ERROR(
      SetInt(FLAGS_checkpoint_keep, 1, 1 << 20, &o.checkpoint_keep));
  o.resume = absl::GetFlag(FLAGS_resume);
  o.checkpoint_on_exit = absl::GetFlag(FLAGS_checkpoint_on_exit);
  return absl::OkStatus();
}

absl::Status SetLimitOptions(ServerOptions& o) {
  TALLY_RETURN_IF_ERROR(SetSeconds(FLAGS_seq_gap_timeout_secs, 0.001, 3600,
                                   &o.seq_gap_timeout_secs));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_seq_cache, 1, 1 << 20, &o.seq_cache));
  TALLY_RETURN_IF_ERROR(
      SetInt(FLAGS_max_queued_requests, 1, 1 << 20, &o.max_queued_requests));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_max_queued_requests_per_model, 1, 1 << 20,
                               &o.max_queued_requests_per_model));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_max_queued_requests_per_tenant, 1, 1 << 20,
                               &o.max_queued_requests_per_tenant));
  TALLY_RETURN_IF_ERROR(
      SetInt(FLAGS_max_memory_bytes, 0, int64_t{1} << 50, &o.max_memory_bytes));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_max_memory_bytes_per_tenant, 0,
                               int64_t{1} << 50,
                               &o.max_memory_bytes_per_tenant));
  TALLY_RETURN_IF_ERROR(SetInt(FLAGS_max_tokens_per_call, 1, int64_t{1} << 34,
                               &o.max_tokens_per_call));
  TALLY_RETURN_IF_ERROR(
      SetSeconds(FLAGS_shutdown_drain_secs, 0, 3600, &o.shutdown_drain_secs));
  TALLY_RETURN_IF_ERROR(
      SetSeconds(FLAGS_exit_timeout_secs, 0.001, 86400, &o.exit_timeout_secs));
  return SetSeconds(FLAGS_collective_timeout_secs, 0.001, 86400,
                    &o.collective_timeout_secs);
}

void SetSecurityOptions(ServerOptions& o) {
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  o.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  o.metrics_auth_file = absl::GetFlag(FLAGS_metrics_auth_file);
  o.allow_insecure_remote = absl::GetFlag(FLAGS_allow_insecure_remote);
}

// The one place the flags' ranges are checked; INVALID_ARGUMENT naming the
// first flag out of range.
absl::StatusOr<ServerOptions> ServerOptionsFromFlags() {
  ServerOptions o;
  TALLY_RETURN_IF_ERROR(SetServingOptions(o));
  TALLY_RETURN_IF_ERROR(SetMeshOptions(o));
  TALLY_RETURN_IF_ERROR(SetTrainingOptions(o));
  TALLY_RETURN_IF_ERROR(SetCheckpointOptions(o));
  TALLY_RETURN_IF_ERROR(SetLimitOptions(o));
  SetSecurityOptions(o);
  return o;
}

// ---------------------------------------------------------------------------
// --help.

constexpr size_t kHelpColumn = 32;
constexpr size_t kUsageWidth = 80;

// `left` ("  --name VALUE"), then `words` from kHelpColumn on, wrapped at
// kUsageWidth (a word longer than a line gets a line of its own).
void AppendUsageEntry(std::string left, const std::vector<std::string>& words,
                      std::string* usage) {
  if (left.size() + 1 > kHelpColumn) {
    absl::StrAppend(usage, left, "\n");
    left.clear();
  }
  std::string line = std::move(left);
  line.resize(kHelpColumn, ' ');
  bool line_empty = true;
  for (const std::string& word : words) {
    if (!line_empty && line.size() + 1 + word.size() > kUsageWidth) {
      absl::StrAppend(usage, line, "\n");
      line.assign(kHelpColumn, ' ');
      line_empty = true;
    }
    absl::StrAppend(&line, line_empty ? "" : " ", word);
    line_empty = false;
  }
  absl::StrAppend(usage, line, "\n");
}

void AppendFlagUsage(const FlagDoc& doc, std::string* usage) {
  std::string left = absl::StrCat("  --", doc.name);
  if (doc.value_name != nullptr) absl::StrAppend(&left, " ", doc.value_name);
  const absl::CommandLineFlag* flag = FindServerFlag(doc.name);
  std::vector<std::string> words;
  if (flag != nullptr) {
    words = absl::StrSplit(flag->Help(), ' ', absl::SkipEmpty());
    const std::string default_value = flag->DefaultValue();
    // The default stays on one line (tests/deploy/server_flags.py reads it).
    words.push_back(absl::StrCat(
        "(default: ", default_value.empty() ? "none" : default_value, ")"));
  }
  AppendUsageEntry(std::move(left), words, usage);
}

}  // namespace

absl::StatusOr<ParsedFlags> ParseServerFlags(int argc,
                                             const char* const* argv) {
  TALLY_RETURN_IF_ERROR(ResetFlagsToDefaults());
  ParsedFlags parsed;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      parsed.help = true;
    } else if (arg == "--version") {
      parsed.version = true;
    } else {
      TALLY_RETURN_IF_ERROR(ParseFlagArgument(argc, argv, &i));
    }
  }
  TALLY_ASSIGN_OR_RETURN(parsed.options, ServerOptionsFromFlags());
  return parsed;
}

std::string ServerUsage() {
  std::string usage =
      "Usage: tally-server [flags]\n\n"
      "Serves tally.v1.Trainer over gRPC and Prometheus metrics over HTTP.\n"
      "SIGTERM/SIGINT: health turns NOT_SERVING, the server keeps serving for\n"
      "--shutdown-drain-secs, then finishes the executing requests, refuses\n"
      "the rest (UNAVAILABLE), checkpoints with --checkpoint-on-exit and\n"
      "exits 0. A dead or hung rank: UNAVAILABLE, exit 1.\n";
  for (const FlagSection& section : Sections()) {
    absl::StrAppend(&usage, "\n", section.title, ":\n");
    for (const FlagDoc& doc : section.flags) AppendFlagUsage(doc, &usage);
  }
  absl::StrAppend(&usage, "\nOther:\n");
  AppendUsageEntry("  --help", {"this", "text"}, &usage);
  AppendUsageEntry("  --version", {"print", "the", "version", "and", "exit"},
                   &usage);
  return usage;
}

}  // namespace tally
