// bench_xent: peak memory and time of the LM head's target log-probabilities
// forward and backward, the chunked kernel
// (kernels/chunked_xent.h) against the composed path it replaced (whole-call
// float32 logits, log_softmax, gather), at a bench shape's head (default
// small: vocab 32000, hidden 512) and 2 x 2048 tokens. Each row runs in a
// fresh process (this binary with --row), so its peak resident set is its
// own; call_peak_bytes is that peak less the resident set before the first
// call (hidden states, weight and targets made), under a fixed glibc mmap
// threshold so that freed chunks leave the resident set. The seconds are
// the median of the --steps calls after it.
//
//   build/bench/bench_xent                    # float32, bfloat16; 1 thread
//   build/bench/bench_xent --tokens=8192 --threads=2
//
// Prints a table, then one JSON line per row: dtype, threads, tokens, vocab,
// hidden, composed_seconds, chunked_seconds (medians of --steps calls),
// composed_call_peak_bytes, chunked_call_peak_bytes.
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
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
#include "bench/bench_rows.h"
#include "kernels/chunked_xent.h"

ABSL_FLAG(std::string, config, "small",
          "the head's shape: small or qwen2.5-0.5b (bench_rows.h)");
ABSL_FLAG(std::string, dtypes, "float32,bfloat16",
          "comma-separated head dtypes: float32, bfloat16, float64");
ABSL_FLAG(int, threads, 1, "LibTorch threads (>= 1)");
ABSL_FLAG(int64_t, tokens, 4096, "tokens per call (>= 1)");
ABSL_FLAG(int, steps, 3, "timed calls per row (>= 1)");
ABSL_FLAG(std::string, row, "",
          "internal: run one row (composed or chunked, with the first "
          "--dtypes) in this process and print its JSON");

namespace tally {
namespace {

constexpr char kUsage[] =
    "The LM head's target log-probabilities: chunked vs composed.\n"
    "usage: bench_xent [--config=small|qwen2.5-0.5b] "
    "[--dtypes=float32,bfloat16] [--threads=N] [--tokens=N] [--steps=N]";

struct Options {
  std::string config;
  std::vector<std::string> dtypes;
  int threads = 1;
  int64_t tokens = 0;
  int steps = 0;
  std::string row;
};

absl::StatusOr<torch::ScalarType> ParseDtype(const std::string& name) {
  if (name == "float32") return torch::kFloat;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float64") return torch::kDouble;
  return absl::InvalidArgumentError(
      absl::StrCat("--dtypes: float32, bfloat16 or float64, got '", name, "'"));
}

absl::StatusOr<Options> OptionsFromFlags() {
  Options o;
  o.config = absl::GetFlag(FLAGS_config);
  TALLY_RETURN_IF_ERROR(BenchConfig(o.config).status());
  o.dtypes = absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ',');
  for (const std::string& dtype : o.dtypes) {
    TALLY_RETURN_IF_ERROR(ParseDtype(dtype).status());
  }
  o.threads = absl::GetFlag(FLAGS_threads);
  o.tokens = absl::GetFlag(FLAGS_tokens);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.row = absl::GetFlag(FLAGS_row);
  if (o.threads < 1)
    return absl::InvalidArgumentError("--threads must be >= 1");
  if (o.tokens < 1) return absl::InvalidArgumentError("--tokens must be >= 1");
  if (o.steps < 1) return absl::InvalidArgumentError("--steps must be >= 1");
  if (!o.row.empty() && o.row != "composed" && o.row != "chunked") {
    return absl::InvalidArgumentError("--row must be composed or chunked");
  }
  return o;
}

// One row in this process: the head's forward and backward, --steps times.
absl::Status RunRow(const Options& options) {
  TALLY_ASSIGN_OR_RETURN(const LlamaConfig config, BenchConfig(options.config));
  TALLY_ASSIGN_OR_RETURN(const torch::ScalarType dtype,
                         ParseDtype(options.dtypes.front()));
  at::set_num_threads(options.threads);
  torch::manual_seed(0);
  const torch::Tensor hidden =
      torch::randn({options.tokens, config.hidden_size})
          .to(dtype)
          .requires_grad_();
  const torch::Tensor weight =
      (torch::randn({config.vocab_size, config.hidden_size}) * 0.02)
          .to(dtype)
          .requires_grad_();
  const torch::Tensor targets =
      torch::randint(config.vocab_size, {options.tokens}, torch::kInt64);
  const bool chunked = options.row == "chunked";
  auto call = [&] {
    const torch::Tensor logprobs =
        chunked ? kernels::ChunkedTargetLogprobs(hidden, weight, targets)
                : kernels::ComposedTargetLogprobs(hidden, weight, targets);
    (-logprobs.sum()).backward();
    hidden.mutable_grad().reset();
    weight.mutable_grad().reset();
  };
  const int64_t before = ResidentBytes();
  call();
  const int64_t call_peak = PeakRssBytes() - before;
  std::vector<double> seconds;
  for (int step = 0; step < options.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    call();
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count());
  }
  nlohmann::json line;
  line["seconds"] = Median(seconds);
  line["call_peak_bytes"] = call_peak;
  std::cout << line.dump() << std::endl;
  return absl::OkStatus();
}

// The measured row of `mode` for `dtype`, in a fresh process.
absl::StatusOr<nlohmann::json> MeasureRow(const Options& options,
                                          const std::string& dtype,
                                          const std::string& mode) {
  // A fixed mmap threshold: under glibc's default (raised after each freed
  // large block) freed chunks stay in the heap and count as resident.
  return LastJsonLine(absl::StrCat(
      "MALLOC_MMAP_THRESHOLD_=1048576 ", ThreadEnvironment(options.threads),
      SelfPath(), " --row=", mode, " --config=", options.config,
      " --dtypes=", dtype, " --threads=", options.threads,
      " --tokens=", options.tokens, " --steps=", options.steps));
}

absl::Status Run(const Options& options) {
  if (!options.row.empty()) return RunRow(options);
  TALLY_ASSIGN_OR_RETURN(const LlamaConfig config, BenchConfig(options.config));
  std::cout << absl::StrFormat("%-9s %7s %7s %12s %11s %12s %11s\n", "dtype",
                               "threads", "tokens", "composed MB", "chunked MB",
                               "composed s", "chunked s");
  std::vector<nlohmann::json> lines;
  for (const std::string& dtype : options.dtypes) {
    TALLY_ASSIGN_OR_RETURN(const nlohmann::json composed,
                           MeasureRow(options, dtype, "composed"));
    TALLY_ASSIGN_OR_RETURN(const nlohmann::json chunked,
                           MeasureRow(options, dtype, "chunked"));
    std::cout << absl::StrFormat(
        "%-9s %7d %7d %12.0f %11.0f %12.3f %11.3f\n", dtype, options.threads,
        options.tokens, composed["call_peak_bytes"].get<double>() / 1e6,
        chunked["call_peak_bytes"].get<double>() / 1e6,
        composed["seconds"].get<double>(), chunked["seconds"].get<double>());
    nlohmann::json& line = lines.emplace_back();
    line["dtype"] = dtype;
    line["threads"] = options.threads;
    line["tokens"] = options.tokens;
    line["vocab"] = config.vocab_size;
    line["hidden"] = config.hidden_size;
    line["composed_seconds"] = composed["seconds"];
    line["chunked_seconds"] = chunked["seconds"];
    line["composed_call_peak_bytes"] = composed["call_peak_bytes"];
    line["chunked_call_peak_bytes"] = chunked["call_peak_bytes"];
  }
  for (const nlohmann::json& line : lines) std::cout << line.dump() << "\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
  return tally::BenchMain("bench_xent", tally::kUsage, argc, argv,
                          tally::OptionsFromFlags, tally::Run);
}
