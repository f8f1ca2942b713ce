// bench_rpc: the server's overhead on ForwardBackward. The same batch on the
// demo model, once through gRPC on loopback to an in-process tally server
// and once as a direct Engine call, in alternating rounds so that machine
// noise hits both alike; reports the median throughput of each and their
// ratio (grpc / in-process), as a table and one JSON line.
//
//   build/bench/bench_rpc                      # 8 samples x 64 tokens
//   build/bench/bench_rpc --rounds=5 --calls=4 --samples=4 --tokens=64
//
// Flags (absl; each >= 1, --help lists them): --rounds (5), --calls (3),
// --samples (8), --tokens (64), --threads (1).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "bench/bench_main.h"
#include "client/trainer_client.h"
#include "runtime/config/llama_config.h"
#include "runtime/engine/engine.h"
#include "server/server.h"

ABSL_FLAG(int, rounds, 5,
          "alternating gRPC / in-process timed rounds, the medians' count "
          "(>= 1)");
ABSL_FLAG(int, calls, 3, "ForwardBackward calls per round (>= 1)");
ABSL_FLAG(int, samples, 8, "samples per ForwardBackward call (>= 1)");
ABSL_FLAG(int, tokens, 64, "tokens per sample (>= 1)");
ABSL_FLAG(int, threads, 1,
          "compute threads (tally-server's --threads; >= 1): the demo model's "
          "matmuls are too small to gain from a second one");

namespace tally {
namespace {

constexpr char kUsage[] =
    "ForwardBackward through gRPC on loopback vs in process.\n"
    "usage: bench_rpc [--rounds=N] [--calls=N] [--samples=N] [--tokens=N] "
    "[--threads=N] "
    "(each >= 1)";

// The flags' values.
struct Options {
  int rounds = 0;   // alternating gRPC / in-process rounds
  int calls = 0;    // ForwardBackward calls per round
  int samples = 0;  // per call
  int tokens = 0;   // per sample
  int threads = 0;  // compute threads
};

// Byte tokens of a fixed pseudo-random text, every target valid.
std::vector<Sample> MakeBatch(const Options& options) {
  std::vector<Sample> batch;
  uint32_t state = 12345;
  for (int s = 0; s < options.samples; ++s) {
    Sample sample;
    for (int t = 0; t <= options.tokens; ++t) {
      state = state * 1664525u + 1013904223u;
      const int32_t token = static_cast<int32_t>((state >> 8) % kByteVocab);
      if (t < options.tokens) sample.input_tokens.push_back(token);
      if (t > 0) sample.target_tokens.push_back(token);
    }
    batch.push_back(std::move(sample));
  }
  return batch;
}

v1::ForwardBackwardRequest ToRequest(const std::vector<Sample>& batch) {
  v1::ForwardBackwardRequest request;
  request.set_model_id(kDemoModelId);
  request.set_reduction(v1::LOSS_REDUCTION_TOKEN_MEAN);
  for (const Sample& sample : batch) {
    v1::Sample* out = request.add_samples();
    out->mutable_input_tokens()->Add(sample.input_tokens.begin(),
                                     sample.input_tokens.end());
    out->mutable_target_tokens()->Add(sample.target_tokens.begin(),
                                      sample.target_tokens.end());
  }
  return request;
}

// Seconds for `calls` runs of `call`, each returning a Status.
template <typename Call>
absl::StatusOr<double> TimeRound(int calls, Call call) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) TALLY_RETURN_IF_ERROR(call());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

absl::Status Run(const Options& options) {
  const std::vector<Sample> batch = MakeBatch(options);
  const v1::ForwardBackwardRequest request = ToRequest(batch);

  // The served side: a single-rank server with the demo model, any port.
  ServerOptions server_options;
  server_options.host = "127.0.0.1";
  server_options.grpc_port = 0;
  server_options.metrics_port = 0;
  server_options.demo_model = true;
  server_options.log_level = "warning";
  server_options.threads = options.threads;
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> served_engine,
                         CreateRankEngine(server_options));
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<TallyServer> server,
      TallyServer::Start(server_options, std::move(served_engine)));
  TrainerClientOptions client_options;
  client_options.target = absl::StrCat("127.0.0.1:", server->grpc_port());
  TrainerClient client(client_options);
  TALLY_RETURN_IF_ERROR(client.WaitForServing(absl::Seconds(30)));

  // The direct side: the same model (same config and seed) in this process.
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                         Engine::CreateSingleRank({}));
  ModelSpec spec;
  spec.model_id = kDemoModelId;
  spec.config = LlamaConfig::EmbeddedDefault();
  spec.default_max_grad_norm = 1.0;
  TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
  ForwardBackwardArgs args;
  args.samples = batch;

  const auto grpc_call = [&] {
    return client.ForwardBackward(request).status();
  };
  const auto direct_call = [&] {
    return engine->ForwardBackward(kDemoModelId, args).status();
  };
  // Warm-up: first-touch allocations and connection setup, untimed.
  TALLY_RETURN_IF_ERROR(grpc_call());
  TALLY_RETURN_IF_ERROR(direct_call());

  std::vector<double> grpc_seconds, direct_seconds;
  for (int round = 0; round < options.rounds; ++round) {
    TALLY_ASSIGN_OR_RETURN(double g, TimeRound(options.calls, grpc_call));
    TALLY_ASSIGN_OR_RETURN(double d, TimeRound(options.calls, direct_call));
    grpc_seconds.push_back(g);
    direct_seconds.push_back(d);
  }
  TALLY_RETURN_IF_ERROR(server->Shutdown());

  const double tokens_per_round =
      static_cast<double>(options.calls) * options.samples * options.tokens;
  const double grpc_tps = tokens_per_round / Median(grpc_seconds);
  const double direct_tps = tokens_per_round / Median(direct_seconds);
  std::cout << absl::StrFormat(
      "ForwardBackward on the demo model (%d parameters), %d samples x %d "
      "tokens per call, %d threads, median of %d rounds of %d calls\n",
      spec.config.WithDefaults().NumParameters(), options.samples,
      options.tokens, at::get_num_threads(), options.rounds, options.calls);
  std::cout << absl::StrFormat("%12s %14s %12s\n", "path", "tokens/s",
                               "s/call");
  std::cout << absl::StrFormat("%12s %14.0f %12.4f\n", "in-process", direct_tps,
                               Median(direct_seconds) / options.calls);
  std::cout << absl::StrFormat("%12s %14.0f %12.4f\n", "grpc", grpc_tps,
                               Median(grpc_seconds) / options.calls);
  std::cout << absl::StrFormat("grpc / in-process throughput: %.3f\n",
                               grpc_tps / direct_tps);
  nlohmann::ordered_json line;
  line["samples"] = options.samples;
  line["tokens"] = options.tokens;
  line["threads"] = at::get_num_threads();
  line["in_process_tokens_per_s"] = direct_tps;
  line["grpc_tokens_per_s"] = grpc_tps;
  line["grpc_over_in_process"] = grpc_tps / direct_tps;
  std::cout << line.dump() << "\n";
  return absl::OkStatus();
}

// INVALID_ARGUMENT naming the first flag out of range.
absl::Status CheckOptions(const Options& options) {
  for (const auto& [flag, value] :
       {std::pair{"rounds", options.rounds}, std::pair{"calls", options.calls},
        std::pair{"samples", options.samples},
        std::pair{"tokens", options.tokens},
        std::pair{"threads", options.threads}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be >= 1, got ", value));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Options> OptionsFromFlags() {
  Options options;
  options.rounds = absl::GetFlag(FLAGS_rounds);
  options.calls = absl::GetFlag(FLAGS_calls);
  options.samples = absl::GetFlag(FLAGS_samples);
  options.tokens = absl::GetFlag(FLAGS_tokens);
  options.threads = absl::GetFlag(FLAGS_threads);
  TALLY_RETURN_IF_ERROR(CheckOptions(options));
  return options;
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
  return tally::BenchMain("bench_rpc", tally::kUsage, argc, argv,
                          tally::OptionsFromFlags, tally::Run);
}
