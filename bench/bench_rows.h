// What the benches that measure each row in fresh processes share
// (bench_train, bench_sample): the model shapes they name, running a row
// process (this binary again, or a PyTorch twin) under a thread environment
// and reading the JSON line it ends with, and the process's peak memory.
//
//   TALLY_ASSIGN_OR_RETURN(tally::LlamaConfig config,
//                          tally::BenchConfig("small"));
//   TALLY_ASSIGN_OR_RETURN(
//       nlohmann::json row,
//       tally::LastJsonLine(absl::StrCat(tally::ThreadEnvironment(2),
//                                        tally::SelfPath(), " --row")));
#ifndef TALLY_BENCH_BENCH_ROWS_H_
#define TALLY_BENCH_BENCH_ROWS_H_

#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runtime/config/llama_config.h"

namespace tally {

// The shape a bench's --config names: small (Llama, vocab 32000, hidden 512,
// 8 layers) or qwen2.5-0.5b (Qwen2.5-0.5B's config.json); INVALID_ARGUMENT
// naming --config otherwise.
inline absl::StatusOr<LlamaConfig> BenchConfig(const std::string& name) {
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

// The resident set now (/proc/self/statm's second field, in pages).
inline int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// The process's peak resident set so far (getrusage's ru_maxrss).
inline int64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

// The last line `command` printed, parsed as JSON.
inline absl::StatusOr<nlohmann::json> LastJsonLine(const std::string& command) {
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
inline std::string ThreadEnvironment(int threads) {
  return absl::StrCat("OMP_WAIT_POLICY=PASSIVE BLIS_NUM_THREADS=", threads,
                      " OMP_NUM_THREADS=", threads,
                      " OPENBLAS_NUM_THREADS=", threads, " ");
}

// This executable's path (/proc/self/exe), to run a row in a fresh copy.
inline std::string SelfPath() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  return n > 0 ? std::string(path, n) : "bench";
}

}  // namespace tally

#endif  // TALLY_BENCH_BENCH_ROWS_H_
