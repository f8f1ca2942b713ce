#include "server/flags.h"

#include <functional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "runtime/log.h"

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
      {"grpc-port", "N", "gRPC port; 0 picks a free one",
       IntFlag("grpc-port", 0, 65535,
               [](ServerOptions& o, int64_t v) { o.grpc_port = v; })},
      {"metrics-port", "N", "Prometheus /metrics port; 0 picks a free one",
       IntFlag("metrics-port", 0, 65535,
               [](ServerOptions& o, int64_t v) { o.metrics_port = v; })},
      {"max-message-bytes", "N", "largest gRPC message accepted or sent",
       IntFlag("max-message-bytes", 1024, (int64_t{1} << 31) - 1,
               [](ServerOptions& o, int64_t v) { o.max_message_bytes = v; })},
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
      {"shutdown-timeout-secs", "S",
       "on SIGTERM/SIGINT, how long in-flight requests may finish",
       IntFlag("shutdown-timeout-secs", 0, 3600,
               [](ServerOptions& o, int64_t v) {
                 o.shutdown_timeout_secs = static_cast<double>(v);
               })},
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
      "SIGTERM/SIGINT: health turns NOT_SERVING, in-flight requests finish,\n"
      "the server exits 0.\n\nFlags:\n";
  for (const FlagSpec& f : Flags()) {
    std::string left = absl::StrCat("  --", f.name);
    if (f.value_name) absl::StrAppend(&left, " ", f.value_name);
    left.resize(std::max<size_t>(left.size() + 1, 32), ' ');
    absl::StrAppend(&usage, left, f.help, "\n");
  }
  absl::StrAppend(&usage, "  --help                        this text\n",
                  "\nDefaults: --host ", defaults.host, " --grpc-port ",
                  defaults.grpc_port, " --metrics-port ", defaults.metrics_port,
                  " --max-message-bytes ", defaults.max_message_bytes,
                  " --log-level ", defaults.log_level, " --max-batch-tokens ",
                  defaults.max_batch_tokens, " --shutdown-timeout-secs ",
                  defaults.shutdown_timeout_secs, " --checkpoint-keep ",
                  defaults.checkpoint_keep, "\n");
  return usage;
}

}  // namespace tally
