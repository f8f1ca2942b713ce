// bench_train: ForwardBackward throughput of a real-shaped model, as MFU
// against a GEMM peak timed in the same process and as a ratio against the
// same model in PyTorch eager (bench/pytorch_train_reference.py under
// Debian's python3-torch, same BLAS, same threads) measured in the same run.
//
//   build/bench/bench_train        # small: {f32, bf16} x {1, 2} threads x ckpt
//   build/bench/bench_train --config=qwen2.5-0.5b --threads=1 --steps=2
//
// Every row runs in fresh processes (this binary with --row, then the
// PyTorch twin), alternating, because BLIS reads its thread count once per
// process. A row: warm-up step, then --steps timed ForwardBackward calls of
// --samples x --tokens tokens (every target valid, cross-entropy, summed);
// the median step gives tokens/s.
//
// FLOPs per token (PaLM, appendix B): 6 N + 12 L H T, where N counts every
// weight of a matmul (the layers and the LM head; not the input embedding,
// a lookup), L layers, H hidden size, T tokens per sample. MFU = achieved
// model FLOP/s over the peak of a 2048^3 matmul of the row's dtype, timed in
// the tally row's process with its threads.
//
// Output: a table, then one JSON line per row with bench "train", config,
// dtype, threads, act_ckpt, tokens_per_s, model_gflops_per_s,
// gemm_peak_gflops_per_s, mfu, pytorch_tokens_per_s, tally_over_pytorch,
// peak_rss_bytes (the tally row process's), call_peak_bytes (its peak less
// the resident size right after CreateModel: gradients and activations),
// pytorch_peak_rss_bytes, blas.
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "bench/bench_main.h"
#include "runtime/compute_backend.h"
#include "runtime/engine.h"
#include "runtime/llama_config.h"

ABSL_FLAG(std::string, config, "small",
          "model shape: small (Llama, vocab 32000, hidden 512, 8 layers) or "
          "qwen2.5-0.5b (random weights)");
ABSL_FLAG(std::string, threads, "1,2", "comma-separated thread counts");
ABSL_FLAG(std::string, dtypes, "float32,bfloat16",
          "comma-separated model dtypes: float32, bfloat16 (mixed "
          "precision), float64");
ABSL_FLAG(std::string, act_ckpt, "off,on",
          "comma-separated activation checkpointing settings (off, on)");
ABSL_FLAG(int, steps, 3, "timed ForwardBackward calls per row (>= 1)");
ABSL_FLAG(int, samples, 2, "samples per call (>= 1)");
ABSL_FLAG(int, tokens, 512, "tokens per sample (>= 1)");
ABSL_FLAG(bool, pytorch, true, "also run the PyTorch eager twin of each row");
ABSL_FLAG(bool, row, false,
          "internal: run one row in this process (with the first --threads "
          "and --act-ckpt) and print its JSON");

namespace tally {
namespace {

constexpr char kUsage[] =
    "ForwardBackward tokens/s, MFU and tally / PyTorch eager.\n"
    "usage: bench_train [--config=small|qwen2.5-0.5b] [--threads=1,2] "
    "[--dtypes=float32,bfloat16] [--act-ckpt=off,on] [--steps=N] "
    "[--samples=N] "
    "[--tokens=N] "
    "[--pytorch=false]";

struct Options {
  std::string config;
  std::vector<int> threads;
  std::vector<bool> act_ckpt;
  std::vector<std::string> dtypes;  // a row: the first
  int steps = 0;
  int samples = 0;
  int tokens = 0;
  bool pytorch = true;
  bool row = false;
};

absl::StatusOr<DType> DTypeFlag(const std::string& name) {
  const std::optional<DType> dtype = DTypeNamed(name);
  if (dtype) return *dtype;
  return absl::InvalidArgumentError(absl::StrCat(
      "--dtypes must list float32, bfloat16 or float64, got '", name, "'"));
}

absl::StatusOr<LlamaConfig> BenchConfig(const std::string& name) {
  LlamaConfig c;
  if (name == "small") {
    c.model_type = "llama";
    c.vocab_size = 32000;
    c.hidden_size = 512;
    c.intermediate_size = 1408;
    c.num_hidden_layers = 8;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 4;
  } else if (name == "qwen2.5-0.5b") {  // Qwen2.5-0.5B's config.json
    c.model_type = "qwen2";
    c.vocab_size = 151936;
    c.hidden_size = 896;
    c.intermediate_size = 4864;
    c.num_hidden_layers = 24;
    c.num_attention_heads = 14;
    c.num_key_value_heads = 2;
    c.tie_word_embeddings = true;
    c.rope_theta = 1000000.0;
    c.rms_norm_eps = 1e-6;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--config must be small or qwen2.5-0.5b, got '", name, "'"));
  }
  c.max_position_embeddings = 4096;
  return c.WithDefaults();
}

// PaLM's 6 N + 12 L H T, N without the input embedding.
double FlopsPerToken(const LlamaConfig& c, int tokens) {
  const double input_embedding =
      static_cast<double>(c.vocab_size) * c.hidden_size;
  const double matmul_weights = c.NumParameters() - input_embedding +
                                (c.tie_word_embeddings ? input_embedding : 0);
  return 6 * matmul_weights +
         12.0 * c.num_hidden_layers * c.hidden_size * tokens;
}

template <typename Fn>
double SecondsOf(Fn fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// The best of 5 timed 2048^3 matmuls (after one untimed), in GFLOP/s.
double GemmPeakGflops(torch::ScalarType dtype) {
  constexpr int64_t n = 2048;
  const torch::Tensor a = torch::randn({n, n}, dtype);
  const torch::Tensor b = torch::randn({n, n}, dtype);
  torch::Tensor c = torch::mm(a, b);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    best = std::min(best, SecondsOf([&] { c = torch::mm(a, b); }));
  }
  return 2.0 * n * n * n / best / 1e9;
}

// Pseudo-random token ids, every target valid.
std::vector<Sample> MakeBatch(const Options& options, int64_t vocab) {
  std::vector<Sample> batch(options.samples);
  uint64_t state = 12345;
  for (Sample& sample : batch) {
    for (int t = 0; t <= options.tokens; ++t) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const auto token = static_cast<int32_t>((state >> 33) % vocab);
      if (t < options.tokens) sample.input_tokens.push_back(token);
      if (t > 0) sample.target_tokens.push_back(token);
    }
  }
  return batch;
}

// The resident set now (/proc/self/statm's second field, in pages).
int64_t RssBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

int64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

// --row: one row's tally measurement in this process, as a JSON line.
absl::Status RunRow(const Options& options) {
  TALLY_RETURN_IF_ERROR(SetComputeThreads(options.threads.front()));
  TALLY_ASSIGN_OR_RETURN(LlamaConfig config, BenchConfig(options.config));
  EngineOptions engine_options;
  engine_options.max_batch_tokens =
      static_cast<int64_t>(options.samples) * options.tokens;
  TALLY_ASSIGN_OR_RETURN(auto engine, Engine::CreateSingleRank(engine_options));
  ModelSpec spec;
  spec.model_id = "bench";
  spec.config = config;
  spec.dtype = *DTypeFlag(options.dtypes.front());
  spec.activation_checkpointing = options.act_ckpt.front();
  TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
  const int64_t model_rss = RssBytes();
  ForwardBackwardArgs args;
  args.samples = MakeBatch(options, config.vocab_size);
  args.reduction = LossReduction::kSum;
  absl::Status status;
  auto step = [&] {
    status.Update(engine->ForwardBackward("bench", args).status());
  };
  step();  // warm-up: first-touch allocations
  std::vector<double> seconds;
  for (int i = 0; i < options.steps; ++i) seconds.push_back(SecondsOf(step));
  TALLY_RETURN_IF_ERROR(status);
  nlohmann::ordered_json line;
  line["tokens_per_s"] =
      options.samples * options.tokens / Median(std::move(seconds));
  line["peak_rss_bytes"] = PeakRssBytes();
  // What a call adds to the model: gradients, activations, workspace.
  line["call_peak_bytes"] = PeakRssBytes() - model_rss;
  line["gemm_peak_gflops_per_s"] =
      GemmPeakGflops(ComputeScalarType(spec.dtype));
  line["blas"] = std::string(BlasVendorName(DetectComputeBackend().blas));
  std::cout << line.dump() << std::endl;
  return absl::OkStatus();
}

// The last line `command` printed, parsed as JSON.
absl::StatusOr<nlohmann::json> LastJsonLine(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("popen failed: " + command);
  std::string output;
  char buffer[4096];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  const std::vector<std::string> lines =
      absl::StrSplit(output, '\n', absl::SkipWhitespace());
  if (status != 0 || lines.empty()) {
    return absl::InternalError(
        absl::StrCat("`", command, "` failed (status ", status, "): ", output));
  }
  nlohmann::json line = nlohmann::json::parse(lines.back(), nullptr, false);
  if (line.is_discarded()) {
    return absl::InternalError("not JSON: " + lines.back());
  }
  return line;
}

// What tally-server runs with (server/main.cc sets OMP_WAIT_POLICY), for
// both sides of a row.
std::string ThreadEnvironment(int threads) {
  return absl::StrCat("OMP_WAIT_POLICY=PASSIVE BLIS_NUM_THREADS=", threads,
                      " OMP_NUM_THREADS=", threads,
                      " OPENBLAS_NUM_THREADS=", threads, " ");
}

std::string SelfPath() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  return n > 0 ? std::string(path, n) : "bench_train";
}

// One row of the table: a model dtype, a thread count, checkpointing.
struct Row {
  std::string dtype;
  int threads = 1;
  bool act_ckpt = false;
};

absl::StatusOr<nlohmann::ordered_json> MeasureRow(const Options& options,
                                                  const Row& r) {
  const std::string shape = absl::StrCat(
      " --config=", options.config, " --steps=", options.steps,
      " --samples=", options.samples, " --tokens=", options.tokens,
      " --threads=", r.threads, " --act-ckpt=", r.act_ckpt ? "on" : "off");
  TALLY_ASSIGN_OR_RETURN(
      nlohmann::json tally,
      LastJsonLine(absl::StrCat(ThreadEnvironment(r.threads), SelfPath(),
                                " --row --dtypes=", r.dtype, shape)));
  TALLY_ASSIGN_OR_RETURN(LlamaConfig config, BenchConfig(options.config));
  const double flops = FlopsPerToken(config, options.tokens);
  nlohmann::ordered_json row;
  row["bench"] = "train";
  row["config"] = options.config;
  row["dtype"] = r.dtype;
  row["threads"] = r.threads;
  row["act_ckpt"] = r.act_ckpt;
  row["tokens_per_s"] = tally["tokens_per_s"];
  const double gflops = tally["tokens_per_s"].get<double>() * flops / 1e9;
  row["model_gflops_per_s"] = gflops;
  row["gemm_peak_gflops_per_s"] = tally["gemm_peak_gflops_per_s"];
  row["mfu"] = gflops / tally["gemm_peak_gflops_per_s"].get<double>();
  row["peak_rss_bytes"] = tally["peak_rss_bytes"];
  row["call_peak_bytes"] = tally["call_peak_bytes"];
  row["blas"] = tally["blas"];
  if (!options.pytorch) return row;
  TALLY_ASSIGN_OR_RETURN(
      nlohmann::json torch_row,
      LastJsonLine(
          absl::StrCat(ThreadEnvironment(r.threads), TALLY_BENCH_PYTHON, " ",
                       TALLY_BENCH_TRAIN_SCRIPT, " --dtype=", r.dtype, shape)));
  row["pytorch_tokens_per_s"] = torch_row["tokens_per_s"];
  row["pytorch_mfu"] = torch_row["tokens_per_s"].get<double>() * flops / 1e9 /
                       tally["gemm_peak_gflops_per_s"].get<double>();
  row["tally_over_pytorch"] = tally["tokens_per_s"].get<double>() /
                              torch_row["tokens_per_s"].get<double>();
  row["pytorch_peak_rss_bytes"] = torch_row["peak_rss_bytes"];
  return row;
}

void PrintTable(const Options& options, const LlamaConfig& config,
                const std::vector<nlohmann::ordered_json>& rows) {
  std::cout << absl::StrFormat(
      "ForwardBackward, config %s (%d parameters), %d samples x %d tokens, "
      "%.1f MFLOP per token, median of %d steps\n",
      options.config, config.NumParameters(), options.samples, options.tokens,
      FlopsPerToken(config, options.tokens) / 1e6, options.steps);
  std::cout << absl::StrFormat("%-8s %7s %8s %10s %9s %10s %6s %10s %9s\n",
                               "dtype", "threads", "act_ckpt", "tokens/s",
                               "GFLOP/s", "GEMM peak", "MFU", "torch t/s",
                               "tally/pt");
  for (const auto& r : rows) {
    const bool torch = r.contains("pytorch_tokens_per_s");
    std::cout << absl::StrFormat(
        "%-8s %7d %8s %10.1f %9.1f %10.1f %6.3f %10s %9s\n",
        r["dtype"].get<std::string>(), r["threads"].get<int>(),
        r["act_ckpt"].get<bool>() ? "on" : "off",
        r["tokens_per_s"].get<double>(), r["model_gflops_per_s"].get<double>(),
        r["gemm_peak_gflops_per_s"].get<double>(), r["mfu"].get<double>(),
        torch ? absl::StrFormat("%.1f", r["pytorch_tokens_per_s"].get<double>())
              : "-",
        torch ? absl::StrFormat("%.3f", r["tally_over_pytorch"].get<double>())
              : "-");
  }
  for (const auto& r : rows) std::cout << r.dump() << "\n";
}

absl::Status Run(const Options& options) {
  if (options.row) return RunRow(options);
  std::vector<nlohmann::ordered_json> rows;
  for (const std::string& dtype : options.dtypes) {
    for (const int threads : options.threads) {
      for (const bool act_ckpt : options.act_ckpt) {
        TALLY_ASSIGN_OR_RETURN(nlohmann::ordered_json row,
                               MeasureRow(options, {dtype, threads, act_ckpt}));
        rows.push_back(std::move(row));
      }
    }
  }
  TALLY_ASSIGN_OR_RETURN(LlamaConfig config, BenchConfig(options.config));
  PrintTable(options, config, rows);
  return absl::OkStatus();
}

absl::StatusOr<Options> OptionsFromFlags() {
  Options o;
  o.config = absl::GetFlag(FLAGS_config);
  TALLY_RETURN_IF_ERROR(BenchConfig(o.config).status());
  for (absl::string_view t :
       absl::StrSplit(absl::GetFlag(FLAGS_threads), ',')) {
    int threads = 0;
    if (!absl::SimpleAtoi(t, &threads) || threads < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--threads must list integers >= 1, got '", t, "'"));
    }
    o.threads.push_back(threads);
  }
  for (absl::string_view setting :
       absl::StrSplit(absl::GetFlag(FLAGS_act_ckpt), ',')) {
    if (setting != "on" && setting != "off") {
      return absl::InvalidArgumentError(
          absl::StrCat("--act-ckpt must list on or off, got '", setting, "'"));
    }
    o.act_ckpt.push_back(setting == "on");
  }
  for (absl::string_view dtype :
       absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ',')) {
    TALLY_RETURN_IF_ERROR(DTypeFlag(std::string(dtype)).status());
    o.dtypes.emplace_back(dtype);
  }
  o.steps = absl::GetFlag(FLAGS_steps);
  o.samples = absl::GetFlag(FLAGS_samples);
  o.tokens = absl::GetFlag(FLAGS_tokens);
  for (const auto& [flag, value] :
       {std::pair{"steps", o.steps}, std::pair{"samples", o.samples},
        std::pair{"tokens", o.tokens}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be >= 1, got ", value));
    }
  }
  o.pytorch = absl::GetFlag(FLAGS_pytorch);
  o.row = absl::GetFlag(FLAGS_row);
  return o;
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
  return tally::BenchMain("bench_train", tally::kUsage, argc, argv,
                          tally::OptionsFromFlags, tally::Run);
}
