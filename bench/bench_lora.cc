// bench_lora: what LoRA adapters on one shared base cost beside full
// fine-tunes of the same model, measured side by side in one process.
//
//   build/bench/bench_lora                  # rank 16, 8 adapters
//   build/bench/bench_lora --rank=64 --adapters=4
//
// Memory: the resident set (RSS, after malloc_trim) grown by the first adapter
// (which brings the base), by each further adapter after one training step (its
// factors, gradients and AdamW moments), and by one full model after the same
// step; the per-adapter growth is reported against admission's estimate
// (AdapterResidentBytes), and --adapters adapters against as many full
// models. Time: the median ForwardBackward + OptimStep of an adapter and of
// the full model on the same batch; LoRA's backward skips the base's weight
// gradients and its step touches the factors only.
//
// Output: a table, then one JSON line with bench "lora".
#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "bench/bench_main.h"
#include "runtime/config/memory_estimate.h"
#include "runtime/engine/engine.h"

ABSL_FLAG(int, rank, 16, "LoRA rank (>= 1)");
ABSL_FLAG(int, adapters, 8, "adapters on the one base (>= 2)");
ABSL_FLAG(int, tokens, 256, "tokens per step, one sample (>= 2)");
ABSL_FLAG(int, steps, 3, "timed steps per model (>= 1)");

namespace tally {
namespace {

constexpr char kUsage[] =
    "Resident memory and step time of LoRA adapters on one base vs full "
    "fine-tunes.\n"
    "usage: bench_lora [--rank=16] [--adapters=8] [--tokens=256] [--steps=3]";

struct Options {
  int rank = 0;
  int adapters = 0;
  int tokens = 0;
  int steps = 0;
};

absl::StatusOr<Options> OptionsFromFlags() {
  Options o{absl::GetFlag(FLAGS_rank), absl::GetFlag(FLAGS_adapters),
            absl::GetFlag(FLAGS_tokens), absl::GetFlag(FLAGS_steps)};
  if (o.rank < 1 || o.adapters < 2 || o.tokens < 2 || o.steps < 1) {
    return absl::InvalidArgumentError(
        "--rank >= 1, --adapters >= 2, --tokens >= 2 and --steps >= 1");
  }
  return o;
}

// A Llama of 44.5M parameters (178 MB of float32).
LlamaConfig BenchModel() {
  LlamaConfig c;
  c.vocab_size = 32000;
  c.hidden_size = 512;
  c.intermediate_size = 1408;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.max_position_embeddings = 4096;
  return c.WithDefaults();
}

// The resident set after handing freed heap memory back (malloc_trim), so
// that what a step allocated and freed does not count as held.
double RssBytes() {
  malloc_trim(0);
  std::ifstream statm("/proc/self/statm");
  double size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE));
}

// One step of `model_id` (a ForwardBackward of one sample, an OptimStep);
// its seconds.
absl::StatusOr<double> Step(Engine& engine, const std::string& model_id,
                            int tokens, int64_t vocab) {
  ForwardBackwardArgs args;
  Sample& sample = args.samples.emplace_back();
  for (int t = 0; t < tokens; ++t) {
    sample.input_tokens.push_back(static_cast<int32_t>((t * 7919) % vocab));
    sample.target_tokens.push_back(
        static_cast<int32_t>(((t + 1) * 7919) % vocab));
  }
  const auto start = std::chrono::steady_clock::now();
  TALLY_RETURN_IF_ERROR(engine.ForwardBackward(model_id, args).status());
  TALLY_RETURN_IF_ERROR(engine.OptimStep(model_id, {}).status());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// The median step time of `model_id` over `steps` (after the first).
absl::StatusOr<double> MedianStep(Engine& engine, const std::string& model_id,
                                  const Options& options, int64_t vocab) {
  std::vector<double> seconds;
  for (int i = 0; i < options.steps; ++i) {
    TALLY_ASSIGN_OR_RETURN(double s,
                           Step(engine, model_id, options.tokens, vocab));
    seconds.push_back(s);
  }
  return Median(seconds);
}

absl::Status Run(const Options& options) {
  const LlamaConfig config = BenchModel();
  TALLY_ASSIGN_OR_RETURN(auto engine, Engine::CreateSingleRank({}));
  ModelSpec spec;
  spec.config = config;
  spec.lora.rank = options.rank;
  spec.lora.alpha = 2.0 * options.rank;

  const double idle = RssBytes();
  double after_first = 0;
  for (int i = 0; i < options.adapters; ++i) {
    spec.model_id = absl::StrCat("adapter-", i);
    spec.lora.seed = i;
    TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
    TALLY_RETURN_IF_ERROR(
        Step(*engine, spec.model_id, options.tokens, config.vocab_size)
            .status());
    if (i == 0) after_first = RssBytes();
  }
  const double with_adapters = RssBytes();
  TALLY_ASSIGN_OR_RETURN(
      const double adapter_step,
      MedianStep(*engine, "adapter-0", options, config.vocab_size));

  ModelSpec full = spec;
  full.model_id = "full";
  full.lora = LoraConfig();
  const double before_full = RssBytes();
  TALLY_RETURN_IF_ERROR(engine->CreateModel(full).status());
  TALLY_RETURN_IF_ERROR(
      Step(*engine, "full", options.tokens, config.vocab_size).status());
  const double full_bytes = RssBytes() - before_full;
  TALLY_ASSIGN_OR_RETURN(
      const double full_step,
      MedianStep(*engine, "full", options, config.vocab_size));

  const double per_adapter =
      (with_adapters - after_first) / (options.adapters - 1);
  const double estimate = AdapterResidentBytes(config, spec.lora.WithDefaults(),
                                               spec.dtype, spec.optimizer, 1);
  nlohmann::ordered_json row;
  row["bench"] = "lora";
  row["parameters"] = config.NumParameters();
  row["rank"] = options.rank;
  row["adapters"] = options.adapters;
  row["first_adapter_rss_bytes"] = after_first - idle;
  row["per_adapter_rss_bytes"] = per_adapter;
  row["adapter_estimate_bytes"] = estimate;
  row["full_model_rss_bytes"] = full_bytes;
  row["adapters_over_full_models"] =
      (with_adapters - idle) / (options.adapters * full_bytes);
  row["adapter_step_s"] = adapter_step;
  row["full_step_s"] = full_step;
  row["full_over_adapter_step"] = full_step / adapter_step;
  std::cout << absl::StrFormat(
      "LoRA rank %d on a %.1fM-parameter Llama, %d adapters, float32\n"
      "  first adapter (with its base)  %8.1f MB\n"
      "  each further adapter (trained) %8.2f MB   (estimate %.2f MB)\n"
      "  one full model (trained)       %8.1f MB\n"
      "  %d adapters / %d full models   %8.3f\n"
      "  step: adapter %.3f s, full %.3f s   (full / adapter %.2f)\n",
      options.rank, config.NumParameters() / 1e6, options.adapters,
      (after_first - idle) / 1e6, per_adapter / 1e6, estimate / 1e6,
      full_bytes / 1e6, options.adapters, options.adapters,
      row["adapters_over_full_models"].get<double>(), adapter_step, full_step,
      full_step / adapter_step);
  std::cout << row.dump() << "\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
  return tally::BenchMain("bench_lora", tally::kUsage, argc, argv,
                          tally::OptionsFromFlags, tally::Run);
}
