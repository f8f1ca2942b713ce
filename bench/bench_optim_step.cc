// bench_optim_step: tally's OptimStep (one stats pass + one fused AdamW pass)
// against the composed LibTorch path (grad.mul_(1/N), clip_grad_norm_,
// torch::optim::AdamW), PyTorch's own (bench/pytorch_reference.py, run as a
// subprocess when Debian's python3-torch is there) and the memory-traffic
// bound, side by side in one run with one thread count.
//
//   build/bench/bench_optim_step                  # 1M, 10M and 50M params
//   build/bench/bench_optim_step --sizes=2000000 --repeats=3 --threads=1
//
// Flags (absl; --help lists them): --sizes=N,... (parameter counts, each
// >= 1000; 1000000,10000000,50000000), --repeats=N (timed runs per median,
// >= 1; 7), --threads=N (>= 1; unset: LibTorch's default), --python=PATH
// (the interpreter of the PyTorch reference; empty: no reference).
//
// The bound is the 8 words per fp32 parameter no OptimStep can avoid (the
// gradient read for the norm; gradient, parameter and both moments read,
// parameter and both moments written) divided by the copy bandwidth (bytes
// read + written per second by a large buffer copy) measured here. Times are
// medians; the table is followed by one JSON line per size. Neither path
// zeroes gradients (the engine's window clear is a separate pass, as
// zero_grad is for PyTorch).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "bench/bench_main.h"
#include "runtime/model/llama_model.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/mesh.h"
#include "runtime/train/accumulation.h"
#include "runtime/train/optimizer.h"

ABSL_FLAG(std::vector<std::string>, sizes,
          std::vector<std::string>({"1000000", "10000000", "50000000"}),
          "comma-separated parameter counts of the models to time, each "
          ">= 1000 (a llama of about that many parameters per size)");
ABSL_FLAG(int, repeats, 7, "timed runs per median (>= 1)");
ABSL_FLAG(std::optional<int>, threads, std::nullopt,
          "LibTorch intra-op threads (>= 1); unset: LibTorch's default");
ABSL_FLAG(std::string, python, TALLY_BENCH_PYTHON,
          "the python3 that runs bench/pytorch_reference.py; empty: no "
          "PyTorch reference");

namespace tally {
namespace {

constexpr char kUsage[] =
    "OptimStep fused vs composed vs PyTorch vs the memory-traffic bound.\n"
    "usage: bench_optim_step [--sizes=N,...] [--repeats=N] [--threads=N] "
    "[--python=PATH (empty: no PyTorch reference)]";

// The window's normalizer and the clip threshold: with N(0, 1) gradients the
// normalized norm exceeds 1 at every size, so both paths really clip.
constexpr double kNormalizer = 256;
constexpr double kMaxGradNorm = 1.0;
constexpr double kUnavoidableBytesPerParam = 8 * sizeof(float);
constexpr int64_t kCopyBufferBytes = int64_t{512} << 20;

// The flags' values.
struct Options {
  std::vector<int64_t> sizes;
  int repeats = 0;
  std::optional<int> threads;  // nullopt: LibTorch's default
  std::string python;          // empty: no PyTorch reference
  std::string reference_script = TALLY_BENCH_REFERENCE_SCRIPT;
};

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// Median seconds of `repeats` timed calls of `run`, after one untimed warm-up
// (first touch of the optimizer state); `prepare` runs untimed before each.
template <typename Prepare, typename Run>
absl::StatusOr<double> TimeMedian(int repeats, Prepare prepare, Run run) {
  std::vector<double> seconds;
  for (int i = 0; i <= repeats; ++i) {
    prepare();
    const auto start = std::chrono::steady_clock::now();
    TALLY_RETURN_IF_ERROR(run());
    if (i > 0) seconds.push_back(Seconds(start));
  }
  return Median(seconds);
}

// Bytes read + written per second by a parallel copy of a buffer far larger
// than the caches.
double CopyBandwidth(int repeats) {
  const int64_t count = kCopyBufferBytes / sizeof(float);
  torch::Tensor source = torch::rand({count});
  torch::Tensor destination = torch::empty({count});
  const float* from = source.data_ptr<float>();
  float* to = destination.data_ptr<float>();
  const absl::StatusOr<double> seconds = TimeMedian(
      repeats, [] {},
      [&] {
        at::parallel_for(0, count, /*grain_size=*/int64_t{1} << 18,
                         [&](int64_t begin, int64_t end) {
                           std::memcpy(to + begin, from + begin,
                                       (end - begin) * sizeof(float));
                         });
        return absl::OkStatus();
      });
  return 2.0 * kCopyBufferBytes / *seconds;
}

// A llama of about `target` parameters: hidden size ~ sqrt(target / 200)
// (64 for 1M, 256 for 10M, 512 for 50M), SwiGLU MLP of 8/3 the hidden size,
// untied embeddings, as many layers as fill the rest.
LlamaConfig TransformerOfSize(int64_t target) {
  LlamaConfig config;
  config.hidden_size =
      std::max<int64_t>(64, 64 * std::llround(std::sqrt(target / 200.0) / 64));
  const int64_t h = config.hidden_size;
  config.intermediate_size = 16 * ((8 * h / 3 + 15) / 16);
  config.vocab_size = std::min<int64_t>(8192, 64 * h);
  config.num_attention_heads = h / 64;
  const int64_t per_layer =
      4 * h * h + 3 * h * config.intermediate_size + 2 * h;
  const int64_t rest = target - 2 * config.vocab_size * h - h;
  config.num_hidden_layers =
      std::max<int64_t>(1, std::llround(static_cast<double>(rest) / per_layer));
  return config.WithDefaults();
}

struct Row {
  int64_t params = 0;
  size_t tensors = 0;
  double fused_s = 0;
  double stats_s = 0;  // the stats pass's share of fused_s
  double composed_s = 0;
  std::optional<double> pytorch_s;
  double copy_bandwidth = 0;  // bytes read + written per second
  double bound_s = 0;
};

struct FusedTimes {
  double total_s = 0;  // ComputeClip + Optimizer::Step
  double stats_s = 0;  // ComputeClip alone: the stats pass and its all-reduce
};

absl::StatusOr<FusedTimes> TimeFused(std::vector<Parameter>& params,
                                     int repeats) {
  std::unique_ptr<Communicator> world;
  TALLY_ASSIGN_OR_RETURN(world, MakeSingleRankCommunicator());
  const Mesh mesh = Mesh::SingleRank();
  Optimizer optimizer(OptimizerKind::kAdamW, &params);
  const AdamParams hp;
  const auto clip = [&] {
    return ComputeClip(params, kNormalizer, mesh, *world, NormType::kL2,
                       kMaxGradNorm);
  };
  FusedTimes times;
  // Gradients stay raw, so every repeat sees the same ones.
  TALLY_ASSIGN_OR_RETURN(
      times.total_s, TimeMedian(
                         repeats, [] {},
                         [&]() -> absl::Status {
                           TALLY_ASSIGN_OR_RETURN(ClipResult result, clip());
                           return optimizer.Step(hp, result.grad_scale);
                         }));
  TALLY_ASSIGN_OR_RETURN(times.stats_s,
                         TimeMedian(
                             repeats, [] {}, [&] { return clip().status(); }));
  return times;
}

absl::StatusOr<double> TimeComposed(const std::vector<Parameter>& model_params,
                                    int repeats) {
  std::vector<torch::Tensor> params, raw_grads;
  for (const Parameter& p : model_params) {
    params.push_back(p.tensor.detach().clone().requires_grad_());
    params.back().mutable_grad() = p.tensor.grad().clone();
    raw_grads.push_back(p.tensor.grad());
  }
  const AdamParams hp;
  torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(hp.learning_rate)
                                        .betas({hp.beta1, hp.beta2})
                                        .eps(hp.eps)
                                        .weight_decay(hp.weight_decay));
  return TimeMedian(
      repeats,
      [&] {
        // mul_ rewrites the gradients: restore the raw ones, untimed.
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < params.size(); ++i) {
          params[i].mutable_grad().copy_(raw_grads[i]);
        }
      },
      [&] {
        return CatchTorch("composed step", [&] {
          {
            torch::NoGradGuard no_grad;
            for (torch::Tensor& p : params) {
              p.mutable_grad().mul_(1 / kNormalizer);
            }
          }
          torch::nn::utils::clip_grad_norm_(params, kMaxGradNorm);
          adamw.step();
        });
      });
}

// The reference script's median for the same shapes, or nullopt (with the
// reason on stderr) when it cannot run.
std::optional<double> TimePyTorch(const Options& options,
                                  const std::vector<Parameter>& params,
                                  int threads) {
  if (options.python.empty()) return std::nullopt;
  std::vector<std::string> shapes;
  for (const Parameter& p : params) {
    shapes.push_back(absl::StrJoin(p.tensor.sizes(), "x"));
  }
  const std::string command =
      absl::StrCat("'", options.python, "' '", options.reference_script,
                   "' --threads ", threads, " --repeats ", options.repeats,
                   " --normalizer ", kNormalizer, " --max-grad-norm ",
                   kMaxGradNorm, " --shapes ", absl::StrJoin(shapes, ","));
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string output;
  char buffer[4096];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  const int exit_status = pclose(pipe);
  const std::vector<std::string> lines =
      absl::StrSplit(output, '\n', absl::SkipWhitespace());
  if (exit_status != 0 || lines.empty()) {
    std::cerr << "pytorch reference skipped (" << options.python << " "
              << options.reference_script << " exited with " << exit_status
              << ")\n";
    return std::nullopt;
  }
  const nlohmann::json result =
      nlohmann::json::parse(lines.back(), nullptr, /*allow_exceptions=*/false);
  if (!result.is_object() || !result.contains("seconds")) {
    std::cerr << "pytorch reference printed no result: " << output << "\n";
    return std::nullopt;
  }
  return result["seconds"].get<double>();
}

absl::StatusOr<Row> MeasureSize(const Options& options, int64_t target,
                                int threads) {
  TALLY_ASSIGN_OR_RETURN(
      std::unique_ptr<LlamaModel> model,
      LlamaModel::Create(TransformerOfSize(target), DType::kFloat32, 1));
  std::vector<Parameter>& params = model->parameters();
  TALLY_RETURN_IF_ERROR(CatchTorch("random gradients", [&] {
    for (Parameter& p : params) {
      p.tensor.mutable_grad() = torch::randn_like(p.tensor.detach());
    }
  }));
  Row row;
  row.params = static_cast<int64_t>(model->NumParameters());
  row.tensors = params.size();
  // Measured next to each size's timings: on a shared machine the bandwidth
  // drifts with the other load.
  row.copy_bandwidth = CopyBandwidth(options.repeats);
  row.bound_s = kUnavoidableBytesPerParam * row.params / row.copy_bandwidth;
  TALLY_ASSIGN_OR_RETURN(FusedTimes fused, TimeFused(params, options.repeats));
  row.fused_s = fused.total_s;
  row.stats_s = fused.stats_s;
  TALLY_ASSIGN_OR_RETURN(row.composed_s, TimeComposed(params, options.repeats));
  row.pytorch_s = TimePyTorch(options, params, threads);
  return row;
}

absl::Status Run(const Options& options) {
  if (options.threads) at::set_num_threads(*options.threads);
  const int threads = at::get_num_threads();
  std::vector<Row> rows;
  for (int64_t size : options.sizes) {
    TALLY_ASSIGN_OR_RETURN(Row row, MeasureSize(options, size, threads));
    rows.push_back(row);
  }

  std::cout << absl::StrFormat(
      "OptimStep (L2 norm + clip + AdamW, fp32), %d threads, median of %d; "
      "bound = %g bytes/param / copy bandwidth (read + written)\n",
      threads, options.repeats, kUnavoidableBytesPerParam);
  std::cout << absl::StrFormat(
      "%11s %7s %8s %10s %10s %11s %10s %10s %12s %15s %14s\n", "params",
      "tensors", "copy_GB/s", "fused_s", "(stats_s)", "composed_s", "pytorch_s",
      "bound_s", "fused/bound", "composed/fused", "pytorch/fused");
  for (const Row& row : rows) {
    std::cout << absl::StrFormat(
        "%11d %7d %8.2f %10.4f %10.4f %11.4f %10s %10.4f %12.2f %15.2f "
        "%14s\n",
        row.params, row.tensors, row.copy_bandwidth / 1e9, row.fused_s,
        row.stats_s, row.composed_s,
        row.pytorch_s ? absl::StrFormat("%.4f", *row.pytorch_s) : "n/a",
        row.bound_s, row.fused_s / row.bound_s, row.composed_s / row.fused_s,
        row.pytorch_s ? absl::StrFormat("%.2f", *row.pytorch_s / row.fused_s)
                      : "n/a");
  }
  for (const Row& row : rows) {
    nlohmann::ordered_json line;
    line["params"] = row.params;
    line["threads"] = threads;
    line["fused_s"] = row.fused_s;
    line["composed_s"] = row.composed_s;
    line["bound_s"] = row.bound_s;
    line["fused_over_bound"] = row.fused_s / row.bound_s;
    line["composed_over_fused"] = row.composed_s / row.fused_s;
    std::cout << line.dump() << "\n";
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT naming the first flag out of range.
absl::Status CheckOptions(const Options& options) {
  if (options.sizes.empty()) {
    return absl::InvalidArgumentError("--sizes: no size given");
  }
  for (int64_t size : options.sizes) {
    if (size < 1000) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sizes: ", size, " is not a count >= 1000"));
    }
  }
  if (options.repeats < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--repeats must be >= 1, got ", options.repeats));
  }
  if (options.threads && *options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads must be >= 1, got ", *options.threads));
  }
  return absl::OkStatus();
}

absl::StatusOr<Options> OptionsFromFlags() {
  Options options;
  for (const std::string& size : absl::GetFlag(FLAGS_sizes)) {
    int64_t value;
    if (!absl::SimpleAtoi(size, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sizes: ", size, " is not a count >= 1000"));
    }
    options.sizes.push_back(value);
  }
  options.repeats = absl::GetFlag(FLAGS_repeats);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.python = absl::GetFlag(FLAGS_python);
  TALLY_RETURN_IF_ERROR(CheckOptions(options));
  return options;
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
  return tally::BenchMain("bench_optim_step", tally::kUsage, argc, argv,
                          tally::OptionsFromFlags, tally::Run);
}
