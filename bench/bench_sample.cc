// bench_sample: prefill and decode tokens/s of tally's Decode (KV cache,
// runtime/sample/decode.h) against PyTorch eager running HF's generate loop
// with a KV cache (bench/pytorch_sample_reference.py under Debian's
// python3-torch, same BLAS, same threads) on the same weights and prompts,
// in the same run.
//
//   build/bench/bench_sample      # small: {f32, bf16} x batch {1, 8, 64}
//                                 #   x {greedy, sample}, 1 thread
//   build/bench/bench_sample --batches=8 --dtypes=bfloat16 --profile
//
// The bench writes one random model (--config; every matrix N(0, 1/fan_in),
// the embedding N(0, 1), norms 1: peaked logits, far from ties) as an HF
// directory of float32 safetensors that both sides read; a bfloat16 row is
// tally's mixed precision on one side and the model cast to bfloat16 on the
// other. Every row runs in fresh processes (this binary with --row, then the
// twin), alternating, because BLIS reads its thread count once per process.
// A row: --batch prompts of --prompt random tokens; untimed warm-up, then
// --rounds x (a call with max_tokens 1: the prefill and the first token;
// a call with 1 + --new-tokens). Prefill tokens/s = batch x prompt over the
// median first call; decode tokens/s = batch x new tokens over the
// difference of the medians. Sampling: temperature 1, no top-k / top-p, a
// seed; each side draws from its own generator, so only greedy rows are
// compared token by token: the twin runs tally's greedy completions through
// one full forward and reports the largest gap between its best logit and
// the logit of tally's token; a row whose gap exceeds kMarginTolerance of
// its dtype is an error, not a speed.
//
// --profile adds, per row, where one decode step of tally's goes: the
// top-level ATen operators (RecordFunction) of a (1 + --new-tokens) call less
// those of the prefill call, per step, and what casting every parameter to
// the compute dtype once costs (what a mixed-precision forward does).
//
// Output: a table, then one JSON line per row with bench "sample", config,
// dtype, batch, mode, threads, prompt, new_tokens, prefill_tokens_per_s,
// decode_tokens_per_s, pytorch_prefill_tokens_per_s,
// pytorch_decode_tokens_per_s, prefill_ratio, decode_ratio (tally /
// PyTorch), greedy_margin and tokens_equal (greedy rows), peak_rss_bytes,
// pytorch_peak_rss_bytes, and with --profile profile (operator: ms per step)
// and weight_cast_ms.
#include <ATen/record_function.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
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
#include "bench/bench_rows.h"
#include "runtime/checkpoint/weights_export.h"
#include "runtime/model/llama_model.h"
#include "runtime/parallel/compute_backend.h"
#include "runtime/sample/decode.h"

ABSL_FLAG(std::string, config, "small", "model shape: small or qwen2.5-0.5b");
ABSL_FLAG(int, threads, 1, "compute threads of both sides (>= 1)");
ABSL_FLAG(std::string, dtypes, "float32,bfloat16",
          "comma-separated model dtypes: float32, bfloat16 (mixed precision)");
ABSL_FLAG(std::string, batches, "1,8,64", "comma-separated prompts per call");
ABSL_FLAG(std::string, modes, "greedy,sample",
          "comma-separated token choices: greedy, sample (temperature 1)");
ABSL_FLAG(int, prompt, 32, "tokens per prompt (>= 1)");
ABSL_FLAG(int, new_tokens, 16, "decoded tokens after the first (>= 1)");
ABSL_FLAG(int, rounds, 2, "timed rounds per row (>= 1)");
ABSL_FLAG(bool, pytorch, true, "also run the PyTorch eager twin of each row");
ABSL_FLAG(bool, profile, false, "profile one decode call of each tally row");
ABSL_FLAG(std::string, python, TALLY_BENCH_PYTHON,
          "the interpreter of the PyTorch twin");
ABSL_FLAG(bool, row, false,
          "internal: run one row (the first --dtypes, --batches and --modes) "
          "in this process and print its JSON");

namespace tally {
namespace {

namespace fs = std::filesystem;

constexpr char kUsage[] =
    "Decode prefill and decode tokens/s, tally / PyTorch eager (KV cache).\n"
    "usage: bench_sample [--config=small] [--threads=1] "
    "[--dtypes=float32,bfloat16] [--batches=1,8,64] [--modes=greedy,sample] "
    "[--prompt=N] [--new-tokens=N] [--rounds=N] [--pytorch=false] "
    "[--profile] [--python=PATH]";

constexpr uint64_t kWeightSeed = 1234;
constexpr uint64_t kSampleSeed = 7;

struct Options {
  std::string config;
  int threads = 1;
  std::vector<std::string> dtypes;  // a row: the first of each list
  std::vector<int> batches;
  std::vector<std::string> modes;
  int prompt = 0;
  int new_tokens = 0;
  int rounds = 0;
  bool pytorch = true;
  bool profile = false;
  bool row = false;
  std::string python;
};

// The largest gap between the twin's best logit and the logit of tally's
// greedy token a row accepts. float32: the two sides differ in rounding
// only, far below 1e-3. bfloat16 keeps 8 significant bits (an ulp of 1/16
// for logits in [8, 16)) and the two sides round in different places, so a
// pick within a few ulps of a tie may differ. Measured: 0 in every row
// (docs/performance.md, Sampling).
double MarginTolerance(const std::string& dtype) {
  return dtype == "bfloat16" ? 0.25 : 1e-3;
}

// Every matrix N(0, 1 / fan_in), the embedding N(0, 1), norms 1: logits of
// a few units whose best token stands clear of the next.
void RandomizeWeights(CausalLm& model) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(kWeightSeed);
  for (Parameter& p : model.parameters()) {
    if (p.tensor.dim() < 2) continue;  // norms keep their 1
    const bool embedding = p.name == "model.embed_tokens.weight";
    const double scale =
        embedding ? 1.0
                  : 1.0 / std::sqrt(static_cast<double>(p.tensor.size(1)));
    p.tensor.copy_(scale * torch::randn(p.tensor.sizes(), torch::kFloat64));
  }
}

absl::StatusOr<std::unique_ptr<LlamaModel>> MakeModel(
    const Options& options, const std::string& dtype) {
  TALLY_ASSIGN_OR_RETURN(LlamaConfig config, BenchConfig(options.config));
  const std::optional<DType> type = DTypeNamed(dtype);
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> model,
                         LlamaModel::Create(config, *type, /*seed=*/1));
  RandomizeWeights(*model);
  return model;
}

// `batch` prompts of `length` pseudo-random tokens (the same on both sides:
// the twin reads them from the file the launcher writes).
std::vector<std::vector<int64_t>> MakePrompts(int batch, int length,
                                              int64_t vocab) {
  std::vector<std::vector<int64_t>> prompts(batch);
  uint64_t state = 12345;
  for (auto& prompt : prompts) {
    for (int t = 0; t < length; ++t) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      prompt.push_back(static_cast<int64_t>((state >> 33) % vocab));
    }
  }
  return prompts;
}

double Seconds(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// Top-level ATen operators' time by name, while an instance is alive (one
// process-wide collector: RecordFunction's callbacks are plain functions).
class OperatorTimes {
 public:
  OperatorTimes() {
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&Enter, &Exit)
                                        .scopes({at::RecordScope::FUNCTION}));
  }
  ~OperatorTimes() { at::removeCallback(handle_); }
  std::map<std::string, double> Take() { return std::move(seconds_); }

 private:
  struct Start : at::ObserverContext {
    std::chrono::steady_clock::time_point time;
  };
  static thread_local int depth_;
  static std::map<std::string, double> seconds_;
  static std::unique_ptr<at::ObserverContext> Enter(const at::RecordFunction&) {
    if (depth_++ > 0) return nullptr;
    auto start = std::make_unique<Start>();
    start->time = std::chrono::steady_clock::now();
    return start;
  }
  static void Exit(const at::RecordFunction& fn, at::ObserverContext* context) {
    --depth_;
    if (context == nullptr) return;
    seconds_[fn.name()] += Seconds(static_cast<Start*>(context)->time);
  }
  at::CallbackHandle handle_;
};
thread_local int OperatorTimes::depth_ = 0;
std::map<std::string, double> OperatorTimes::seconds_;

// The milliseconds per decode step of each top-level operator (a full call
// less a prefill call), and of casting every parameter to the compute dtype.
absl::Status Profile(LlamaModel& model, DecodeRequest request,
                     const Options& options, nlohmann::ordered_json& line) {
  std::map<std::string, double> prefill, full;
  for (const int64_t tokens : {int64_t{1}, int64_t{1} + options.new_tokens}) {
    request.max_tokens = tokens;
    OperatorTimes times;
    TALLY_RETURN_IF_ERROR(Decode(model, request).status());
    (tokens == 1 ? prefill : full) = times.Take();
  }
  nlohmann::ordered_json profile;
  for (const auto& [name, seconds] : full) {
    const double per_step =
        1e3 * (seconds - prefill[name]) / options.new_tokens;
    if (per_step > 0.01) profile[name] = per_step;
  }
  line["profile"] = profile;
  const auto start = std::chrono::steady_clock::now();
  for (const Parameter& p : model.parameters()) {
    (void)p.tensor.to(model.compute_type());
  }
  line["weight_cast_ms"] = 1e3 * Seconds(start);
  return absl::OkStatus();
}

// --row: one row's tally measurement in this process, as a JSON line.
absl::Status RunRow(const Options& options) {
  TALLY_RETURN_IF_ERROR(SetComputeThreads(options.threads));
  const std::string& dtype = options.dtypes.front();
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> model,
                         MakeModel(options, dtype));
  DecodeRequest request;
  request.prompts = MakePrompts(options.batches.front(), options.prompt,
                                model->config().vocab_size);
  request.sampling.temperature = options.modes.front() == "greedy" ? 0 : 1;
  request.seed = kSampleSeed;
  std::vector<DecodedSequence> last;
  auto timed = [&](int64_t max_tokens) -> absl::StatusOr<double> {
    request.max_tokens = max_tokens;
    const auto start = std::chrono::steady_clock::now();
    TALLY_ASSIGN_OR_RETURN(last, Decode(*model, request));
    return Seconds(start);
  };
  const int64_t full_tokens = 1 + options.new_tokens;
  TALLY_RETURN_IF_ERROR(timed(1).status());  // warm-up
  TALLY_RETURN_IF_ERROR(timed(full_tokens).status());
  std::vector<double> prefill, full;
  for (int round = 0; round < options.rounds; ++round) {
    TALLY_ASSIGN_OR_RETURN(const double prefill_s, timed(1));
    TALLY_ASSIGN_OR_RETURN(const double full_s, timed(full_tokens));
    prefill.push_back(prefill_s);
    full.push_back(full_s);
  }
  const double prefill_s = Median(prefill), full_s = Median(full);
  const int batch = options.batches.front();
  nlohmann::ordered_json line;
  line["prefill_tokens_per_s"] = batch * options.prompt / prefill_s;
  line["decode_tokens_per_s"] =
      batch * options.new_tokens / (full_s - prefill_s);
  line["prefill_s"] = prefill_s;
  line["full_s"] = full_s;
  nlohmann::json tokens = nlohmann::json::array();
  for (const DecodedSequence& sequence : last)
    tokens.push_back(sequence.tokens);
  line["tokens"] = tokens;
  line["peak_rss_bytes"] = PeakRssBytes();
  if (options.profile) {
    TALLY_RETURN_IF_ERROR(Profile(*model, request, options, line));
  }
  std::cout << line.dump() << std::endl;
  return absl::OkStatus();
}

absl::Status WriteJson(const fs::path& path, const nlohmann::json& value) {
  std::ofstream out(path);
  out << value.dump();
  out.close();
  if (!out) return absl::InternalError("cannot write " + path.string());
  return absl::OkStatus();
}

// A temporary directory holding the weights both sides read.
struct Workspace {
  fs::path root;
  ~Workspace() {
    if (!root.empty()) fs::remove_all(root);
  }
};

absl::Status WriteWeights(const Options& options, Workspace& workspace) {
  std::string pattern =
      (fs::temp_directory_path() / "bench_sample_XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError("mkdtemp failed for " + pattern);
  }
  workspace.root = pattern;
  TALLY_ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> model,
                         MakeModel(options, "float32"));
  ExportOptions export_options;
  export_options.dtype = ExportDType::kFloat32;
  return WriteWeightsExport((workspace.root / "model").string(), *model,
                            export_options, "")
      .status();
}

// One row of the table.
struct Row {
  std::string dtype;
  int batch = 1;
  std::string mode;
};

// The twin's side of row `r` (tally's fields in `row`, its greedy tokens in
// `tally`): speeds, ratios and, for greedy, the token check.
absl::Status AddTwin(const Options& options, const Row& r,
                     const Workspace& workspace, const nlohmann::json& tally,
                     nlohmann::ordered_json& row) {
  TALLY_ASSIGN_OR_RETURN(LlamaConfig config, BenchConfig(options.config));
  const fs::path prompts = workspace.root / "prompts.json";
  const fs::path check = workspace.root / "check.json";
  TALLY_RETURN_IF_ERROR(WriteJson(
      prompts,
      {{"prompts", MakePrompts(r.batch, options.prompt, config.vocab_size)}}));
  TALLY_RETURN_IF_ERROR(WriteJson(check, {{"tokens", tally["tokens"]}}));
  std::string command = absl::StrCat(
      ThreadEnvironment(options.threads), options.python, " ",
      TALLY_BENCH_SAMPLE_SCRIPT,
      " --weights=", (workspace.root / "model").string(),
      " --prompts=", prompts.string(), " --dtype=", r.dtype,
      " --threads=", options.threads, " --new-tokens=", options.new_tokens,
      " --rounds=", options.rounds, " --mode=", r.mode,
      " --seed=", kSampleSeed);
  if (r.mode == "greedy")
    absl::StrAppend(&command, " --check=", check.string());
  TALLY_ASSIGN_OR_RETURN(nlohmann::json twin, LastJsonLine(command));
  if (twin["batch"] != r.batch || twin["mode"] != r.mode ||
      twin["prompt"] != options.prompt ||
      twin["new_tokens"] != options.new_tokens || twin["dtype"] != r.dtype) {
    return absl::InternalError("the PyTorch twin ran another workload: " +
                               twin.dump());
  }
  for (const char* phase : {"prefill", "decode"}) {
    const std::string field = absl::StrCat(phase, "_tokens_per_s");
    row["pytorch_" + field] = twin[field];
    row[absl::StrCat(phase, "_ratio")] =
        tally[field].get<double>() / twin[field].get<double>();
  }
  row["pytorch_peak_rss_bytes"] = twin["peak_rss_bytes"];
  if (r.mode != "greedy") return absl::OkStatus();
  const double margin = twin["check_margin"].get<double>();
  row["greedy_margin"] = margin;
  row["tokens_equal"] = twin["tokens"] == tally["tokens"];
  if (margin > MarginTolerance(r.dtype)) {
    return absl::InternalError(absl::StrFormat(
        "%s batch %d: tally's greedy tokens are not the twin's (a token %g "
        "below the best logit, over the %g a %s row allows); no speed is "
        "reported for a wrong answer",
        r.dtype, r.batch, margin, MarginTolerance(r.dtype), r.dtype));
  }
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::ordered_json> MeasureRow(const Options& options,
                                                  const Row& r,
                                                  const Workspace& workspace) {
  const std::string shape = absl::StrCat(
      " --config=", options.config, " --threads=", options.threads,
      " --prompt=", options.prompt, " --new-tokens=", options.new_tokens,
      " --rounds=", options.rounds, " --profile=", options.profile);
  TALLY_ASSIGN_OR_RETURN(
      nlohmann::json tally,
      LastJsonLine(absl::StrCat(ThreadEnvironment(options.threads), SelfPath(),
                                " --row --dtypes=", r.dtype, " --batches=",
                                r.batch, " --modes=", r.mode, shape)));
  nlohmann::ordered_json row;
  row["bench"] = "sample";
  row["config"] = options.config;
  row["dtype"] = r.dtype;
  row["batch"] = r.batch;
  row["mode"] = r.mode;
  row["threads"] = options.threads;
  row["prompt"] = options.prompt;
  row["new_tokens"] = options.new_tokens;
  row["prefill_tokens_per_s"] = tally["prefill_tokens_per_s"];
  row["decode_tokens_per_s"] = tally["decode_tokens_per_s"];
  row["peak_rss_bytes"] = tally["peak_rss_bytes"];
  if (options.pytorch) {
    TALLY_RETURN_IF_ERROR(AddTwin(options, r, workspace, tally, row));
  }
  for (const char* field : {"profile", "weight_cast_ms"}) {
    if (tally.contains(field)) row[field] = tally[field];
  }
  return row;
}

// --profile: per row, a decode step's time and its costliest operators.
void PrintProfiles(const std::vector<nlohmann::ordered_json>& rows) {
  for (const auto& r : rows) {
    if (!r.contains("profile")) continue;
    std::vector<std::pair<double, std::string>> ops;
    for (const auto& [name, ms] : r["profile"].items()) {
      ops.emplace_back(ms.get<double>(), name);
    }
    std::sort(ops.rbegin(), ops.rend());
    std::cout << absl::StrFormat(
        "\n%s batch %d %s: %.2f ms per decode step (timed), casting every "
        "parameter to the compute dtype once: %.2f ms; top-level operators, "
        "ms per step (profiled):\n",
        r["dtype"].get<std::string>(), r["batch"].get<int>(),
        r["mode"].get<std::string>(),
        1e3 * r["batch"].get<int>() / r["decode_tokens_per_s"].get<double>(),
        r["weight_cast_ms"].get<double>());
    for (size_t i = 0; i < ops.size() && i < 8; ++i) {
      std::cout << absl::StrFormat("  %-24s %8.2f\n", ops[i].second,
                                   ops[i].first);
    }
  }
}

void PrintTable(const Options& options,
                const std::vector<nlohmann::ordered_json>& rows) {
  std::cout << absl::StrFormat(
      "Decode on cpu, config %s, %d thread(s), prompts of %d tokens, %d "
      "decoded tokens after the first, median of %d rounds\n",
      options.config, options.threads, options.prompt, options.new_tokens,
      options.rounds);
  std::cout << absl::StrFormat(
      "%-8s %5s %6s | %10s %10s %7s | %9s %9s %7s | %7s\n", "dtype", "batch",
      "mode", "prefill/s", "torch", "ratio", "decode/s", "torch", "ratio",
      "margin");
  for (const auto& r : rows) {
    auto number = [&](const char* field, int digits) {
      return r.contains(field)
                 ? absl::StrFormat("%.*f", digits, r[field].get<double>())
                 : std::string("-");
    };
    std::cout << absl::StrFormat(
        "%-8s %5d %6s | %10s %10s %7s | %9s %9s %7s | %7s\n",
        r["dtype"].get<std::string>(), r["batch"].get<int>(),
        r["mode"].get<std::string>(), number("prefill_tokens_per_s", 1),
        number("pytorch_prefill_tokens_per_s", 1), number("prefill_ratio", 3),
        number("decode_tokens_per_s", 1),
        number("pytorch_decode_tokens_per_s", 1), number("decode_ratio", 3),
        number("greedy_margin", 4));
  }
  PrintProfiles(rows);
  for (const auto& r : rows) std::cout << r.dump() << "\n";
}

absl::Status Run(const Options& options) {
  if (options.row) return RunRow(options);
  Workspace workspace;
  TALLY_RETURN_IF_ERROR(WriteWeights(options, workspace));
  std::vector<nlohmann::ordered_json> rows;
  for (const std::string& dtype : options.dtypes) {
    for (const int batch : options.batches) {
      for (const std::string& mode : options.modes) {
        std::cerr << "bench_sample: " << dtype << " batch " << batch << " "
                  << mode << "\n";
        TALLY_ASSIGN_OR_RETURN(
            nlohmann::ordered_json row,
            MeasureRow(options, {dtype, batch, mode}, workspace));
        rows.push_back(std::move(row));
      }
    }
  }
  PrintTable(options, rows);
  return absl::OkStatus();
}

// The comma-separated values of `flag`, each one of `allowed`.
absl::StatusOr<std::vector<std::string>> ListFlag(
    const char* flag, const std::string& value,
    const std::vector<std::string>& allowed) {
  std::vector<std::string> out;
  for (absl::string_view item : absl::StrSplit(value, ',')) {
    if (std::find(allowed.begin(), allowed.end(), item) == allowed.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must list ",
                       absl::StrJoin(allowed, " or "), ", got '", item, "'"));
    }
    out.emplace_back(item);
  }
  return out;
}

absl::StatusOr<Options> OptionsFromFlags() {
  Options o;
  o.config = absl::GetFlag(FLAGS_config);
  TALLY_RETURN_IF_ERROR(BenchConfig(o.config).status());
  TALLY_ASSIGN_OR_RETURN(
      o.dtypes,
      ListFlag("dtypes", absl::GetFlag(FLAGS_dtypes), {"float32", "bfloat16"}));
  TALLY_ASSIGN_OR_RETURN(o.modes, ListFlag("modes", absl::GetFlag(FLAGS_modes),
                                           {"greedy", "sample"}));
  for (absl::string_view b :
       absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    int batch = 0;
    if (!absl::SimpleAtoi(b, &batch) || batch < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--batches must list integers >= 1, got '", b, "'"));
    }
    o.batches.push_back(batch);
  }
  o.threads = absl::GetFlag(FLAGS_threads);
  o.prompt = absl::GetFlag(FLAGS_prompt);
  o.new_tokens = absl::GetFlag(FLAGS_new_tokens);
  o.rounds = absl::GetFlag(FLAGS_rounds);
  for (const auto& [flag, value] :
       {std::pair{"threads", o.threads}, std::pair{"prompt", o.prompt},
        std::pair{"new-tokens", o.new_tokens}, std::pair{"rounds", o.rounds}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be >= 1, got ", value));
    }
  }
  o.pytorch = absl::GetFlag(FLAGS_pytorch);
  o.profile = absl::GetFlag(FLAGS_profile);
  o.row = absl::GetFlag(FLAGS_row);
  o.python = absl::GetFlag(FLAGS_python);
  return o;
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
  return tally::BenchMain("bench_sample", tally::kUsage, argc, argv,
                          tally::OptionsFromFlags, tally::Run);
}
