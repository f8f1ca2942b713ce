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
// device, dtype, threads, act_ckpt, tokens_per_s, model_gflops_per_s,
// gemm_peak_gflops_per_s, mfu, pytorch_tokens_per_s, tally_over_pytorch,
// peak_rss_bytes (the tally row process's), call_peak_bytes (its peak less
// the resident size right after CreateModel: gradients and activations),
// pytorch_peak_rss_bytes, blas.
//
// --device=cuda: both sides of every row on GPU 0 (the twin under --python,
// a torch with CUDA), every timing bracketed by a device synchronize, the
// GEMM peak an 8192^3 matmul on the GPU, in the row's process. The row also
// times OptimStep (after each of --steps further ForwardBackward calls) and
// gives its bound: the bytes AdamW must move (masters, gradients and both
// moments read, masters and moments written: 7 x the master dtype's size per
// parameter) over the bandwidth of a device-to-device copy timed in the same
// process. Extra fields: optim_step_s, optim_hbm_bound_s,
// optim_over_hbm_bound, copy_gb_per_s, estimated_device_bytes (memory
// admission's estimate of the model and the call), gpu,
// pytorch_device_peak_bytes.
//
// (one command line, split here without the shell's backslashes):
//   bench_train --device=cuda --config=qwen2.5-0.5b --dtypes=bfloat16
//       --threads=1 --act-ckpt=off --samples=16 --tokens=2048
//       --max-batch-tokens=8192 --python=/opt/torch/.venv/bin/python3
#include <sys/resource.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
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
#include "runtime/parallel/compute_backend.h"
#if TALLY_WITH_NCCL
#include "runtime/cuda/nccl_communicator.h"
#endif
#include "runtime/config/llama_config.h"
#include "runtime/config/memory_estimate.h"
#include "runtime/engine/engine.h"

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
ABSL_FLAG(std::string, device, "cpu",
          "where both sides of every row train: cpu, or cuda (GPU 0)");
ABSL_FLAG(bool, allow_tf32, false,
          "cuda: TF32 matmuls for float32 rows (EngineOptions::allow_tf32), "
          "in the twin and the GEMM peak alike");
ABSL_FLAG(int64_t, max_batch_tokens, 0,
          "tokens per micro-batch, on both sides (0: the whole call, "
          "--samples x --tokens)");
ABSL_FLAG(std::string, python, TALLY_BENCH_PYTHON,
          "the interpreter of the PyTorch twin (for cuda: one whose torch has "
          "CUDA)");
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
    "[--pytorch=false] [--device=cpu|cuda] [--allow-tf32] "
    "[--max-batch-tokens=N] [--python=PATH]";

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
  std::string device;  // cpu or cuda
  bool allow_tf32 = false;
  int64_t max_batch_tokens = 0;  // resolved: never 0
  std::string python;
};

torch::Device BenchDevice(const Options& options) {
  return options.device == "cuda" ? torch::Device(torch::kCUDA, 0)
                                  : torch::Device(torch::kCPU);
}

absl::StatusOr<DType> DTypeFlag(const std::string& name) {
  const std::optional<DType> dtype = DTypeNamed(name);
  if (dtype) return *dtype;
  return absl::InvalidArgumentError(absl::StrCat(
      "--dtypes must list float32, bfloat16 or float64, got '", name, "'"));
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

// Seconds `fn` takes, including the GPU work it queues on `device`.
template <typename Fn>
double SecondsOf(const torch::Device& device, Fn fn) {
  if (device.is_cuda()) torch::cuda::synchronize();
  const auto start = std::chrono::steady_clock::now();
  fn();
  if (device.is_cuda()) torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// The best of 5 timed n^3 matmuls (after 3 untimed), in GFLOP/s: n = 2048 on
// the CPU, 8192 on a GPU (smaller ones leave its tensor cores idle).
double GemmPeakGflops(torch::ScalarType dtype, const torch::Device& device) {
  const int64_t n = device.is_cuda() ? 8192 : 2048;
  const auto options = torch::TensorOptions().dtype(dtype).device(device);
  const torch::Tensor a = torch::randn({n, n}, options);
  const torch::Tensor b = torch::randn({n, n}, options);
  torch::Tensor c;
  for (int i = 0; i < 3; ++i) c = torch::mm(a, b);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    best = std::min(best, SecondsOf(device, [&] { c = torch::mm(a, b); }));
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

// The bytes per second of a device-to-device copy of 1 GiB (read plus
// written), the best of 5 after one untimed.
double CopyBytesPerSecond(const torch::Device& device) {
  const torch::Tensor source =
      torch::ones({int64_t{1} << 28},
                  torch::TensorOptions().dtype(torch::kFloat).device(device));
  torch::Tensor target = torch::empty_like(source);
  target.copy_(source);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    best = std::min(best, SecondsOf(device, [&] { target.copy_(source); }));
  }
  return 2.0 * static_cast<double>(source.nbytes()) / best;
}

// The GPU fields of a row (bench_train's header): OptimStep after each of
// --steps more ForwardBackward calls, and the bound its bytes give.
absl::Status MeasureOptimStep(Engine& engine, const ForwardBackwardArgs& args,
                              const Options& options, const ModelSpec& spec,
                              nlohmann::ordered_json& line) {
  const torch::Device device = BenchDevice(options);
  std::vector<double> seconds;
  for (int i = 0; i < options.steps; ++i) {
    TALLY_RETURN_IF_ERROR(engine.ForwardBackward("bench", args).status());
    absl::StatusOr<OptimStepResult> result;
    seconds.push_back(SecondsOf(
        device, [&] { result = engine.OptimStep("bench", OptimStepArgs()); }));
    TALLY_RETURN_IF_ERROR(result.status());
    if (result->skipped) {
      return absl::InternalError("OptimStep skipped: " + result->skip_reason);
    }
  }
  const double master_bytes =
      MasterDType(spec.dtype) == DType::kFloat64 ? 8.0 : 4.0;
  const double adamw_bytes = 7.0 * master_bytes * ParameterCount(spec.config);
  const double copy_bytes_per_s = CopyBytesPerSecond(device);
  const double optim_s = Median(std::move(seconds));
  line["optim_step_s"] = optim_s;
  line["optim_hbm_bound_s"] = adamw_bytes / copy_bytes_per_s;
  line["optim_over_hbm_bound"] = optim_s / (adamw_bytes / copy_bytes_per_s);
  line["copy_gb_per_s"] = copy_bytes_per_s / 1e9;
  line["estimated_device_bytes"] =
      ModelResidentBytes(spec.config, spec.dtype, OptimizerKind::kAdamW,
                         /*dp_shard=*/1) +
      CallActivationBytes(spec.config, spec.dtype,
                          std::vector<int64_t>(options.samples, options.tokens),
                          options.max_batch_tokens, EngineOptions().attention,
                          spec.activation_checkpointing);
  return absl::OkStatus();
}

// --row: one row's tally measurement in this process, as a JSON line.
absl::Status RunRow(const Options& options) {
  TALLY_RETURN_IF_ERROR(SetComputeThreads(options.threads.front()));
  TALLY_ASSIGN_OR_RETURN(LlamaConfig config, BenchConfig(options.config));
  const torch::Device device = BenchDevice(options);
  EngineOptions engine_options;
  engine_options.max_batch_tokens = options.max_batch_tokens;
  engine_options.device = device;
  engine_options.allow_tf32 = options.allow_tf32;
  TALLY_ASSIGN_OR_RETURN(auto engine, Engine::CreateSingleRank(engine_options));
  ModelSpec spec;
  spec.model_id = "bench";
  spec.config = config;
  spec.dtype = *DTypeFlag(options.dtypes.front());
  spec.activation_checkpointing = options.act_ckpt.front();
  TALLY_RETURN_IF_ERROR(engine->CreateModel(spec).status());
  const int64_t model_rss = ResidentBytes();
  ForwardBackwardArgs args;
  args.samples = MakeBatch(options, config.vocab_size);
  args.reduction = LossReduction::kSum;
  absl::Status status;
  auto step = [&] {
    status.Update(engine->ForwardBackward("bench", args).status());
  };
  step();  // warm-up: first-touch allocations
  std::vector<double> seconds;
  for (int i = 0; i < options.steps; ++i) {
    seconds.push_back(SecondsOf(device, step));
  }
  TALLY_RETURN_IF_ERROR(status);
  nlohmann::ordered_json line;
  line["device"] = device.str();
  line["tokens_per_s"] =
      options.samples * options.tokens / Median(std::move(seconds));
  line["peak_rss_bytes"] = PeakRssBytes();
  // What a call adds to the model: gradients, activations, workspace.
  line["call_peak_bytes"] = PeakRssBytes() - model_rss;
  if (device.is_cuda()) {
    TALLY_RETURN_IF_ERROR(MeasureOptimStep(*engine, args, options, spec, line));
  }
  line["gemm_peak_gflops_per_s"] =
      GemmPeakGflops(ComputeScalarType(spec.dtype), device);
  line["blas"] = std::string(BlasVendorName(DetectComputeBackend().blas));
  std::cout << line.dump() << std::endl;
  return absl::OkStatus();
}

// One row of the table: a model dtype, a thread count, checkpointing.
struct Row {
  std::string dtype;
  int threads = 1;
  bool act_ckpt = false;
};

// INTERNAL unless the twin ran what the row ran: a tally / PyTorch ratio of
// two different workloads must not reach the table.
absl::Status CheckSameWorkload(const nlohmann::json& twin,
                               const Options& options, const Row& r) {
  const nlohmann::json expected = {{"device", options.device},
                                   {"dtype", r.dtype},
                                   {"config", options.config},
                                   {"samples", options.samples},
                                   {"tokens", options.tokens}};
  for (const auto& field : expected.items()) {
    const std::string& key = field.key();
    if (!twin.contains(key) || twin[key] != field.value()) {
      return absl::InternalError(absl::StrCat(
          "the PyTorch twin ran ", key, " ",
          twin.contains(key) ? twin[key].dump() : "(missing)", " but the row ",
          field.value().dump(), ": ", twin.dump()));
    }
  }
  return absl::OkStatus();
}

// The fields MeasureOptimStep adds on a GPU.
constexpr const char* kDeviceFields[] = {
    "optim_step_s", "optim_hbm_bound_s", "optim_over_hbm_bound",
    "copy_gb_per_s", "estimated_device_bytes"};

absl::StatusOr<nlohmann::ordered_json> MeasureRow(const Options& options,
                                                  const Row& r) {
  const std::string shape = absl::StrCat(
      " --config=", options.config, " --steps=", options.steps,
      " --samples=", options.samples, " --tokens=", options.tokens,
      " --threads=", r.threads, " --act-ckpt=", r.act_ckpt ? "on" : "off",
      " --device=", options.device,
      " --max-batch-tokens=", options.max_batch_tokens,
      " --allow-tf32=", options.allow_tf32 ? "true" : "false");
  TALLY_ASSIGN_OR_RETURN(
      nlohmann::json tally,
      LastJsonLine(absl::StrCat(ThreadEnvironment(r.threads), SelfPath(),
                                " --row --dtypes=", r.dtype, shape)));
  TALLY_ASSIGN_OR_RETURN(LlamaConfig config, BenchConfig(options.config));
  const double flops = FlopsPerToken(config, options.tokens);
  nlohmann::ordered_json row;
  row["bench"] = "train";
  row["config"] = options.config;
  row["device"] = tally["device"];
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
  for (const char* field : kDeviceFields) {
    if (tally.contains(field)) row[field] = tally[field];
  }
  if (!options.pytorch) return row;
  TALLY_ASSIGN_OR_RETURN(
      nlohmann::json torch_row,
      LastJsonLine(absl::StrCat(ThreadEnvironment(r.threads), options.python,
                                " ", TALLY_BENCH_TRAIN_SCRIPT,
                                " --dtype=", r.dtype, shape)));
  TALLY_RETURN_IF_ERROR(CheckSameWorkload(torch_row, options, r));
  row["pytorch_tokens_per_s"] = torch_row["tokens_per_s"];
  row["pytorch_mfu"] = torch_row["tokens_per_s"].get<double>() * flops / 1e9 /
                       tally["gemm_peak_gflops_per_s"].get<double>();
  row["tally_over_pytorch"] = tally["tokens_per_s"].get<double>() /
                              torch_row["tokens_per_s"].get<double>();
  row["pytorch_peak_rss_bytes"] = torch_row["peak_rss_bytes"];
  if (torch_row.contains("gpu")) row["gpu"] = torch_row["gpu"];
  if (torch_row.contains("device_peak_bytes")) {
    row["pytorch_device_peak_bytes"] = torch_row["device_peak_bytes"];
  }
  return row;
}

// On a GPU: OptimStep against the HBM bound of its bytes.
void PrintOptimStepTable(const std::vector<nlohmann::ordered_json>& rows) {
  std::cout << absl::StrFormat("\nOptimStep (AdamW), median of --steps\n");
  std::cout << absl::StrFormat("%-8s %8s %12s %12s %9s %10s\n", "dtype",
                               "act_ckpt", "step ms", "HBM bound ms", "x bound",
                               "copy GB/s");
  for (const auto& r : rows) {
    std::cout << absl::StrFormat("%-8s %8s %12.3f %12.3f %9.2f %10.1f\n",
                                 r["dtype"].get<std::string>(),
                                 r["act_ckpt"].get<bool>() ? "on" : "off",
                                 1e3 * r["optim_step_s"].get<double>(),
                                 1e3 * r["optim_hbm_bound_s"].get<double>(),
                                 r["optim_over_hbm_bound"].get<double>(),
                                 r["copy_gb_per_s"].get<double>());
  }
}

void PrintTable(const Options& options, const LlamaConfig& config,
                const std::vector<nlohmann::ordered_json>& rows) {
  std::cout << absl::StrFormat(
      "ForwardBackward on %s, config %s (%d parameters), %d samples x %d "
      "tokens, %.1f MFLOP per token, median of %d steps\n",
      options.device, options.config, config.NumParameters(), options.samples,
      options.tokens, FlopsPerToken(config, options.tokens) / 1e6,
      options.steps);
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
  if (options.device == "cuda") PrintOptimStepTable(rows);
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
  o.device = absl::GetFlag(FLAGS_device);
  if (o.device != "cpu" && o.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be cpu or cuda, got '", o.device, "'"));
  }
  if (o.device == "cuda" && !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(
        "--device=cuda: no CUDA device is usable (none visible, or this "
        "LibTorch has no CUDA)");
  }
  o.allow_tf32 = absl::GetFlag(FLAGS_allow_tf32);
  o.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  if (o.max_batch_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-batch-tokens must be >= 0, got ", o.max_batch_tokens));
  }
  if (o.max_batch_tokens == 0) {
    o.max_batch_tokens = static_cast<int64_t>(o.samples) * o.tokens;
  }
  o.python = absl::GetFlag(FLAGS_python);
  return o;
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
#if TALLY_WITH_NCCL
  tally::InstallNcclCommunicators();
#endif
  return tally::BenchMain("bench_train", tally::kUsage, argc, argv,
                          tally::OptionsFromFlags, tally::Run);
}
