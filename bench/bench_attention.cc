// bench_attention: peak memory and time of a ForwardBackward whose attention
// is materialized (the [T, T] scores per head) or blocked (online softmax
// over blocks of keys, runtime/model/blocked_attention.h), side by side in one
// process, at growing sample lengths.
//
//   build/bench/bench_attention                   # 1k, 4k and 16k tokens
//   build/bench/bench_attention --lengths=2048 --block-keys=256
//
// The model is one Llama layer with one 128-wide head, so attention is most
// of what a call holds. Peak: the resident set's high-water mark (VmHWM,
// reset through /proc/self/clear_refs before each call) less the resident
// set before it. Time: one call after a warm-up call of the same length.
//
// Output: a table, then one JSON line per length with bench "attention".
#include <malloc.h>

#include <chrono>
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
#include "runtime/engine/engine.h"

ABSL_FLAG(std::string, lengths, "1024,4096,16384",
          "comma-separated sample lengths in tokens");
ABSL_FLAG(int64_t, block_keys, 512, "keys per block of blocked attention");

namespace tally {
namespace {

constexpr char kUsage[] =
    "Peak memory and time of materialized vs blocked attention.\n"
    "usage: bench_attention [--lengths=1024,4096,16384] [--block-keys=512]";

struct Options {
  std::vector<int64_t> lengths;
  int64_t block_keys = 0;
};

absl::StatusOr<Options> OptionsFromFlags() {
  Options o;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_lengths), ',')) {
    int64_t length = 0;
    if (!absl::SimpleAtoi(part, &length) || length < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("--lengths: '", part, "' is not a length >= 2"));
    }
    o.lengths.push_back(length);
  }
  o.block_keys = absl::GetFlag(FLAGS_block_keys);
  if (o.block_keys < 1) {
    return absl::InvalidArgumentError("--block-keys must be >= 1");
  }
  return o;
}

// Resets the resident set's high-water mark and returns the resident set.
double ResetPeak() {
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";
  std::ifstream statm("/proc/self/statm");
  double size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE));
}

// VmHWM of /proc/self/status, in bytes.
double PeakBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    double kib = 0;
    if (absl::StartsWith(line, "VmHWM:") &&
        absl::SimpleAtod(
            absl::StripAsciiWhitespace(absl::StripSuffix(line.substr(6), "kB")),
            &kib)) {
      return kib * 1024;
    }
  }
  return 0;
}

struct Measured {
  double peak_bytes = 0;
  double seconds = 0;
};

absl::StatusOr<Measured> MeasureCall(const Options& options, AttentionMode mode,
                                     int64_t length) {
  EngineOptions engine_options;
  engine_options.max_batch_tokens = length;
  engine_options.attention.mode = mode;
  engine_options.attention.block_keys = options.block_keys;
  TALLY_ASSIGN_OR_RETURN(auto engine, Engine::CreateSingleRank(engine_options));
  ModelSpec spec;
  spec.model_id = "m";
  spec.config.vocab_size = 256;
  spec.config.hidden_size = 128;
  spec.config.intermediate_size = 256;
  spec.config.num_hidden_layers = 1;
  spec.config.num_attention_heads = 1;
  spec.config.num_key_value_heads = 1;
  spec.config.max_position_embeddings = length;
  TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
  ForwardBackwardArgs args;
  Sample& sample = args.samples.emplace_back();
  for (int64_t t = 0; t < length; ++t) {
    sample.input_tokens.push_back(static_cast<int32_t>((t * 31) % 256));
    sample.target_tokens.push_back(static_cast<int32_t>((t * 31 + 7) % 256));
  }
  args.forward_only = false;
  TALLY_RETURN_IF_ERROR(engine->ForwardBackward("m", args).status());
  TALLY_RETURN_IF_ERROR(engine->AbortAccumulation("m").status());
  Measured measured;
  const double before = ResetPeak();
  const auto start = std::chrono::steady_clock::now();
  TALLY_RETURN_IF_ERROR(engine->ForwardBackward("m", args).status());
  measured.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  measured.peak_bytes = PeakBytes() - before;
  return measured;
}

absl::Status Run(const Options& options) {
  std::cout << absl::StrFormat("%8s %18s %15s %14s %11s %12s\n", "tokens",
                               "materialized MB", "blocked MB",
                               "materialized s", "blocked s", "memory ratio");
  for (int64_t length : options.lengths) {
    TALLY_ASSIGN_OR_RETURN(
        const Measured materialized,
        MeasureCall(options, AttentionMode::kMaterialized, length));
    TALLY_ASSIGN_OR_RETURN(
        const Measured blocked,
        MeasureCall(options, AttentionMode::kBlocked, length));
    std::cout << absl::StrFormat("%8d %18.1f %15.1f %14.3f %11.3f %12.1f\n",
                                 length, materialized.peak_bytes / 1e6,
                                 blocked.peak_bytes / 1e6, materialized.seconds,
                                 blocked.seconds,
                                 materialized.peak_bytes / blocked.peak_bytes);
    nlohmann::ordered_json row;
    row["bench"] = "attention";
    row["tokens"] = length;
    row["block_keys"] = options.block_keys;
    row["materialized_peak_bytes"] = materialized.peak_bytes;
    row["blocked_peak_bytes"] = blocked.peak_bytes;
    row["materialized_s"] = materialized.seconds;
    row["blocked_s"] = blocked.seconds;
    std::cout << row.dump() << "\n";
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
  return tally::BenchMain("bench_attention", tally::kUsage, argc, argv,
                          tally::OptionsFromFlags, tally::Run);
}
