#include "server/flags.h"

#include <functional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"

namespace tally {
namespace {

struct FlagSpec {
  const char* name;
  const char* value_name;  // nullptr for booleans
  const char* help;
  std::function<absl::Status(ServerOptions&, const std::string&)> set;
};

absl::Status BadValue(const char* flag, const std::string& value,
                      const char* expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": expected ", expected, ", got '", value, "'"));
}

auto StringFlag(std::string ServerOptions::*field) {
  return [field](ServerOptions& o, const std::string& v) -> absl::Status {
    o.*field = v;
    return absl::OkStatus();
  };
}

auto BoolFlag(const char* flag, bool ServerOptions::*field) {
  return [flag, field](ServerOptions& o, const std::string& v) -> absl::Status {
    if (v != "true" && v != "false") return BadValue(flag, v, "true or false");
    o.*field = v == "true";
    return absl::OkStatus();
  };
}

auto IntFlag(const char* flag, int64_t min, int64_t max,
             std::function<void(ServerOptions&, int64_t)> assign) {
  return [=](ServerOptions& o, const std::string& v) -> absl::Status {
    int64_t parsed;
    if (!absl::SimpleAtoi(v, &parsed) || parsed < min || parsed > max) {
      return BadValue(
          flag, v,
          absl::StrCat("an integer in [", min, ", ", max, "]").c_str());
    }
    assign(o, parsed);
    return absl::OkStatus();
  };
}

auto SecondsFlag(const char* flag, double min, double max,
                 std::function<void(ServerOptions&, double)> assign) {
  return [=](ServerOptions& o, const std::string& v) -> absl::Status {
    double parsed;
    if (!absl::SimpleAtod(v, &parsed) || !(parsed >= min && parsed <= max)) {
      return BadValue(
          flag, v, absl::StrCat("seconds in [", min, ", ", max, "]").c_str());
    }
    assign(o, parsed);
    return absl::OkStatus();
  };
}

const std::vector<FlagSpec>& Flags() {
  static const auto* flags = new std::vector<FlagSpec>{
      {"nproc-per-node", "N",
       "launch and supervise N local rank processes (like torchrun)",
       IntFlag("nproc-per-node", 1, 1024,
               [](ServerOptions& o, int64_t v) { o.nproc_per_node = v; })},
      {"dp-replicate", "N", "data-parallel replicas (gradients all-reduced)",
       IntFlag("dp-replicate", 1, 1024,
               [](ServerOptions& o, int64_t v) { o.mesh.dp_replicate = v; })},
      {"dp-shard", "N", "ZeRO-3 / FSDP parameter shards",
       IntFlag("dp-shard", 1, 1024,
               [](ServerOptions& o, int64_t v) { o.mesh.dp_shard = v; })},
      {"cp", "N",
       "context-parallel ranks (each sample's tokens split over them)",
       IntFlag("cp", 1, 1024,
               [](ServerOptions& o, int64_t v) { o.mesh.cp = v; })},
      {"ep", "N",
       "expert-parallel ranks, carved out of dp-shard x cp (MoE models)",
       IntFlag("ep", 1, 1024,
               [](ServerOptions& o, int64_t v) { o.mesh.ep = v; })},
      {"pp", "N",
       "pipeline stages (contiguous runs of decoder layers, 1F1B schedule)",
       IntFlag("pp", 1, 1024,
               [](ServerOptions& o, int64_t v) { o.mesh.pp = v; })},
      {"pp-microbatches", "N",
       "micro-batches each call is cut into under --pp (default: --pp)",
       IntFlag("pp-microbatches", 1, 1 << 20,
               [](ServerOptions& o, int64_t v) { o.pp_microbatches = v; })},
      {"tp", "N", "Megatron tensor-parallel ranks",
       IntFlag("tp", 1, 1024,
               [](ServerOptions& o, int64_t v) { o.mesh.tp = v; })},
      {"rank", "R", "this process's rank (overrides RANK / LWS_WORKER_INDEX)",
       IntFlag("rank", 0, 1 << 20,
               [](ServerOptions& o, int64_t v) { o.rank_env.rank = v; })},
      {"world-size", "N", "ranks in the world (overrides WORLD_SIZE)",
       IntFlag("world-size", 1, 1 << 20,
               [](ServerOptions& o, int64_t v) { o.rank_env.world_size = v; })},
      {"master-addr", "HOST", "rank 0's address (overrides MASTER_ADDR)",
       [](ServerOptions& o, const std::string& v) {
         o.rank_env.master_addr = v;
         return absl::OkStatus();
       }},
      {"master-port", "N", "rendezvous port on rank 0 (overrides MASTER_PORT)",
       IntFlag(
           "master-port", 1, 65535,
           [](ServerOptions& o, int64_t v) { o.rank_env.master_port = v; })},
      {"rendezvous-timeout-secs", "S",
       "how long ranks retry reaching rank 0 (DNS may lag in Kubernetes)",
       IntFlag("rendezvous-timeout-secs", 1, 86400,
               [](ServerOptions& o, int64_t v) {
                 o.rendezvous_timeout_secs = static_cast<double>(v);
               })},
      {"host", "ADDR", "address to listen on (gRPC and metrics)",
       [](ServerOptions& o, const std::string& v) {
         o.host = v;
         return absl::OkStatus();
       }},
      {"grpc-port", "N", "gRPC port (local rank r: N + r); 0 picks a free one",
       IntFlag("grpc-port", 0, 65535,
               [](ServerOptions& o, int64_t v) { o.grpc_port = v; })},
      {"metrics-port", "N",
       "Prometheus /metrics port (local rank r: N + r); 0 picks a free one",
       IntFlag("metrics-port", 0, 65535,
               [](ServerOptions& o, int64_t v) { o.metrics_port = v; })},
      {"max-message-bytes", "N", "largest gRPC message accepted or sent",
       IntFlag("max-message-bytes", 1024, (int64_t{1} << 31) - 1,
               [](ServerOptions& o, int64_t v) { o.max_message_bytes = v; })},
      {"max-memory-bytes", "N",
       "memory admission: bytes this rank's models and a call's activations "
       "may take, by estimate (0: 80% of the machine's or cgroup's memory / "
       "local ranks)",
       IntFlag("max-memory-bytes", 0, int64_t{1} << 50,
               [](ServerOptions& o, int64_t v) { o.max_memory_bytes = v; })},
      {"max-memory-bytes-per-tenant", "N",
       "memory admission per authenticated tenant (0: no quota)",
       IntFlag("max-memory-bytes-per-tenant", 0, int64_t{1} << 50,
               [](ServerOptions& o, int64_t v) {
                 o.max_memory_bytes_per_tenant = v;
               })},
      {"max-tokens-per-call", "N",
       "tokens of one ForwardBackward, all samples together",
       IntFlag("max-tokens-per-call", 1, int64_t{1} << 34,
               [](ServerOptions& o, int64_t v) { o.max_tokens_per_call = v; })},
      {"log-level", "LEVEL", "debug, info, warning or error",
       [](ServerOptions& o, const std::string& v) -> absl::Status {
         if (!ParseLogLevel(v).ok()) {
           return BadValue("log-level", v, "debug, info, warning or error");
         }
         o.log_level = v;
         return absl::OkStatus();
       }},
      {"demo-model", nullptr,
       "create model 'demo' (the embedded default Llama) at start",
       BoolFlag("demo-model", &ServerOptions::demo_model)},
      {"port-file", "PATH",
       "write {\"grpc_port\": N, \"metrics_port\": M} here once serving",
       [](ServerOptions& o, const std::string& v) {
         o.port_file = v;
         return absl::OkStatus();
       }},
      {"max-batch-tokens", "N",
       "padded tokens per forward/backward micro-batch (memory bound)",
       IntFlag("max-batch-tokens", 1, int64_t{1} << 30,
               [](ServerOptions& o, int64_t v) { o.max_batch_tokens = v; })},
      {"bucket-mb", "N",
       "MiB per flat bucket of the gradient all-reduce over replicas",
       IntFlag("bucket-mb", 1, 1 << 16,
               [](ServerOptions& o, int64_t v) { o.bucket_mb = v; })},
      {"overlap-grad-sync", nullptr,
       "EAGER: sum gradient buckets during backward (=false: after it)",
       BoolFlag("overlap-grad-sync", &ServerOptions::overlap_grad_sync)},
      // Reliability (docs/reliability.md).
      {"seq-gap-timeout-secs", "S",
       "how long a missing seq_id may hold back the requests behind it "
       "(then ABORTED, window poisoned)",
       SecondsFlag(
           "seq-gap-timeout-secs", 0.001, 3600,
           [](ServerOptions& o, double v) { o.seq_gap_timeout_secs = v; })},
      {"seq-cache", "N",
       "responses kept per model for retried sequenced requests",
       IntFlag("seq-cache", 1, 1 << 20,
               [](ServerOptions& o, int64_t v) { o.seq_cache = v; })},
      {"max-queued-requests", "N",
       "requests held at once (waiting, queued, executing); beyond: "
       "RESOURCE_EXHAUSTED",
       IntFlag("max-queued-requests", 1, 1 << 20,
               [](ServerOptions& o, int64_t v) { o.max_queued_requests = v; })},
      {"max-queued-requests-per-model", "N",
       "requests held at once for one model",
       IntFlag("max-queued-requests-per-model", 1, 1 << 20,
               [](ServerOptions& o, int64_t v) {
                 o.max_queued_requests_per_model = v;
               })},
      {"max-queued-requests-per-tenant", "N",
       "requests held at once for one authenticated tenant",
       IntFlag("max-queued-requests-per-tenant", 1, 1 << 20,
               [](ServerOptions& o, int64_t v) {
                 o.max_queued_requests_per_tenant = v;
               })},
      {"shutdown-drain-secs", "S",
       "on SIGTERM/SIGINT, keep serving this long while NOT_SERVING",
       SecondsFlag(
           "shutdown-drain-secs", 0, 3600,
           [](ServerOptions& o, double v) { o.shutdown_drain_secs = v; })},
      {"exit-timeout-secs", "S",
       "on SIGTERM/SIGINT, exit within this (drain included; 1 if overrun)",
       SecondsFlag(
           "exit-timeout-secs", 0.001, 86400,
           [](ServerOptions& o, double v) { o.exit_timeout_secs = v; })},
      {"collective-timeout-secs", "S",
       "a collective waiting longer on a dead or hung rank fails; the server "
       "then exits non-zero",
       SecondsFlag(
           "collective-timeout-secs", 0.001, 86400,
           [](ServerOptions& o, double v) { o.collective_timeout_secs = v; })},
      {"checkpoint-root", "DIR",
       "client checkpoint paths must lie inside DIR (relative: under it)",
       StringFlag(&ServerOptions::checkpoint_root)},
      {"checkpoint-dir", "DIR",
       "periodic checkpoints and --resume: DIR/<model>/step-<N>/",
       StringFlag(&ServerOptions::checkpoint_dir)},
      {"checkpoint-every-steps", "N",
       "checkpoint a model into --checkpoint-dir every N optimizer steps",
       IntFlag(
           "checkpoint-every-steps", 0, int64_t{1} << 40,
           [](ServerOptions& o, int64_t v) { o.checkpoint_every_steps = v; })},
      {"checkpoint-keep", "K", "periodic checkpoints kept per model (newest)",
       IntFlag("checkpoint-keep", 1, 1 << 20,
               [](ServerOptions& o, int64_t v) { o.checkpoint_keep = v; })},
      {"resume", nullptr,
       "at start, load each model's newest valid checkpoint in "
       "--checkpoint-dir",
       BoolFlag("resume", &ServerOptions::resume)},
      {"checkpoint-on-exit", nullptr,
       "on SIGTERM/SIGINT, after the last request, checkpoint every model "
       "into --checkpoint-dir (a pending window's gradients are dropped)",
       BoolFlag("checkpoint-on-exit", &ServerOptions::checkpoint_on_exit)},
      {"tls-cert", "PEM", "serve TLS with this certificate chain",
       StringFlag(&ServerOptions::tls_cert)},
      {"tls-key", "PEM", "private key of --tls-cert",
       StringFlag(&ServerOptions::tls_key)},
      {"tls-client-ca", "PEM",
       "require client certificates signed by this CA (mutual TLS)",
       StringFlag(&ServerOptions::tls_client_ca)},
      {"auth-tokens-file", "PATH",
       "require 'authorization: Bearer <token>'; lines '<token> <tenant>'",
       StringFlag(&ServerOptions::auth_tokens_file)},
      {"metrics-auth-file", "PATH",
       "require HTTP Basic auth on /metrics; one line '<user>:<password>' "
       "(needed with --auth-tokens-file on a non-loopback --host)",
       StringFlag(&ServerOptions::metrics_auth_file)},
      {"allow-insecure-remote", nullptr,
       "allow a non-loopback --host without TLS",
       BoolFlag("allow-insecure-remote",
                &ServerOptions::allow_insecure_remote)},
  };
  return *flags;
}

}  // namespace

absl::StatusOr<ParsedFlags> ParseServerFlags(int argc,
                                             const char* const* argv) {
  ParsedFlags parsed;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      parsed.help = true;
      continue;
    }
    if (arg == "--version") {
      parsed.version = true;
      continue;
    }
    if (!absl::StartsWith(arg, "--")) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' (see --help)"));
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
      has_value = true;
    }
    const FlagSpec* spec = nullptr;
    for (const FlagSpec& f : Flags()) {
      if (name == f.name) spec = &f;
    }
    if (spec == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    if (!has_value) {
      if (spec->value_name == nullptr) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " needs a value"));
      }
    }
    if (absl::Status s = spec->set(parsed.options, value); !s.ok()) return s;
  }
  return parsed;
}

std::string ServerUsage() {
  const ServerOptions defaults;
  std::string usage =
      "Usage: tally-server [flags]\n\n"
      "Serves tally.v1.Trainer over gRPC and Prometheus metrics over HTTP.\n"
      "SIGTERM/SIGINT: health turns NOT_SERVING, the server keeps serving for\n"
      "--shutdown-drain-secs, then finishes the executing requests, refuses\n"
      "the rest (UNAVAILABLE), checkpoints with --checkpoint-on-exit and\n"
      "exits 0. A dead or hung rank: UNAVAILABLE, exit 1.\n\nFlags:\n";
  for (const FlagSpec& f : Flags()) {
    std::string left = absl::StrCat("  --", f.name);
    if (f.value_name) absl::StrAppend(&left, " ", f.value_name);
    left.resize(std::max<size_t>(left.size() + 1, 32), ' ');
    absl::StrAppend(&usage, left, f.help, "\n");
  }
  absl::StrAppend(
      &usage, "  --help                        this text\n",
      "  --version                     print the version and exit\n",
      "\nDefaults: --host ", defaults.host, " --grpc-port ", defaults.grpc_port,
      " --metrics-port ", defaults.metrics_port, " --max-message-bytes ",
      defaults.max_message_bytes, " --log-level ", defaults.log_level,
      " --max-batch-tokens ", defaults.max_batch_tokens, " --bucket-mb ",
      defaults.bucket_mb, "\n          --seq-gap-timeout-secs ",
      defaults.seq_gap_timeout_secs, " --seq-cache ", defaults.seq_cache,
      " --max-queued-requests ", defaults.max_queued_requests,
      " --max-queued-requests-per-model ",
      defaults.max_queued_requests_per_model,
      " --max-queued-requests-per-tenant ",
      defaults.max_queued_requests_per_tenant,
      "\n          --shutdown-drain-secs ", defaults.shutdown_drain_secs,
      " --exit-timeout-secs ", defaults.exit_timeout_secs,
      " --collective-timeout-secs ", defaults.collective_timeout_secs,
      " --checkpoint-keep ", defaults.checkpoint_keep, "\n");
  return usage;
}

}  // namespace tally
