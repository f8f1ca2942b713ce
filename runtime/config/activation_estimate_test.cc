// Call admission's activation estimate (runtime/config/memory_estimate.h)
// against what a ForwardBackward really takes: over a grid of shapes (heads and
// head size, samples x tokens, dtype, materialized or blocked attention,
// activation checkpointing, LoRA), the peak RSS growth of one call, measured
// in a forked child process, is at most the estimate and at least 2/3 of it.
//
// The child allocates through mmap from 128 KiB on (mallopt), so freed
// tensors leave the process and the peak of one call is its own, and resets
// the peak (/proc/self/clear_refs) after a first small call that allocated
// the gradients (resident bytes, charged to the model, not the call). Shapes
// are sized so that the estimate is tens of MiB or more: allocator noise is
// small beside it.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/config/memory_estimate.h"
#include "runtime/engine/engine.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

struct Shape {
  const char* name;
  int64_t heads;
  int64_t head_dim;
  int64_t layers;
  int samples;
  int64_t tokens;  // per sample
  DType dtype;
  AttentionMode attention;
  bool checkpointing = false;
  int64_t lora_rank = 0;
};

constexpr int64_t kVocab = 64;
constexpr int64_t kBatchTokens = 16384;

ModelSpec SpecOf(const Shape& shape) {
  ModelSpec spec = testing::TinySpec("m", shape.dtype, OptimizerKind::kAdamW);
  LlamaConfig& c = spec.config;
  c.vocab_size = kVocab;
  c.num_attention_heads = shape.heads;
  c.num_key_value_heads = shape.heads;
  c.hidden_size = shape.heads * shape.head_dim;
  c.intermediate_size = 2 * c.hidden_size;
  c.num_hidden_layers = shape.layers;
  c.max_position_embeddings = shape.tokens;
  spec.activation_checkpointing = shape.checkpointing;
  spec.lora.rank = shape.lora_rank;
  return spec;
}

AttentionOptions AttentionOf(const Shape& shape) {
  AttentionOptions attention;
  attention.mode = shape.attention;
  return attention;
}

double Estimate(const Shape& shape) {
  const ModelSpec spec = SpecOf(shape);
  return CallActivationBytes(spec.config.WithDefaults(), spec.dtype,
                             std::vector<int64_t>(shape.samples, shape.tokens),
                             kBatchTokens, AttentionOf(shape),
                             spec.activation_checkpointing);
}

// "<field>: <n> kB" of /proc/self/status, in bytes.
double StatusBytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      return 1024.0 * std::stod(line.substr(field.size() + 1));
    }
  }
  return -1;
}

// What GrowthOfOneCall returns where the kernel does not let a process
// reset its peak RSS: nothing can be measured.
constexpr double kCannotResetPeak = -2;

// In the child: the growth of the peak RSS over one ForwardBackward of
// `shape`, or -1 when something failed.
double GrowthOfOneCall(const Shape& shape) {
  mallopt(M_MMAP_THRESHOLD, 128 << 10);
  mallopt(M_TRIM_THRESHOLD, 128 << 10);
  EngineOptions options;
  options.attention = AttentionOf(shape);
  options.max_batch_tokens = kBatchTokens;
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::CreateSingleRank(options);
  if (!engine.ok() || !(*engine)->CreateModel(SpecOf(shape)).ok()) return -1;
  auto call = [&](int samples, int64_t tokens) {
    ForwardBackwardArgs args;
    for (int i = 0; i < samples; ++i) {
      const int length = static_cast<int>(tokens);
      args.samples.push_back(testing::MakeSample(kVocab, length, length, i));
    }
    return (*engine)->ForwardBackward("m", args).ok();
  };
  if (!call(1, 8)) return -1;  // allocates the gradients
  const double baseline = StatusBytes("VmRSS");
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";  // the peak := now
  clear.close();
  if (!clear) return kCannotResetPeak;
  if (!call(shape.samples, shape.tokens)) return -1;
  return StatusBytes("VmHWM") - baseline;
}

double MeasuredGrowth(const Shape& shape) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    const double growth = GrowthOfOneCall(shape);
    const ssize_t written = write(fds[1], &growth, sizeof(growth));
    _exit(written == sizeof(growth) ? 0 : 1);
  }
  close(fds[1]);
  double growth = -1;
  if (pid < 0 || read(fds[0], &growth, sizeof(growth)) != sizeof(growth)) {
    growth = -1;
  }
  close(fds[0]);
  int status = 0;
  if (pid > 0) waitpid(pid, &status, 0);
  return growth;
}

TEST(ActivationEstimateTest, BoundsWhatOneCallTakes) {
  const std::vector<Shape> grid = {
      // The report's shape, scaled down: 16 heads of 2, one layer.
      {"materialized_h16_d2_l1_4x512", 16, 2, 1, 4, 512, DType::kFloat32,
       AttentionMode::kMaterialized},
      {"materialized_h4_d16_l2_2x512", 4, 16, 2, 2, 512, DType::kFloat32,
       AttentionMode::kMaterialized},
      {"materialized_h8_d8_l3_1x512_f64", 8, 8, 3, 1, 512, DType::kFloat64,
       AttentionMode::kMaterialized},
      {"materialized_h8_d8_l2_2x512_bf16", 8, 8, 2, 2, 512, DType::kBFloat16,
       AttentionMode::kMaterialized},
      {"materialized_h8_d8_l3_2x512_ckpt", 8, 8, 3, 2, 512, DType::kFloat32,
       AttentionMode::kMaterialized, /*checkpointing=*/true},
      {"materialized_h8_d8_l2_2x512_lora", 8, 8, 2, 2, 512, DType::kFloat32,
       AttentionMode::kMaterialized, false, /*lora_rank=*/4},
      {"blocked_h8_d8_l2_1x2048", 8, 8, 2, 1, 2048, DType::kFloat32,
       AttentionMode::kBlocked},
      {"blocked_h4_d32_l1_2x1024_ckpt", 4, 32, 1, 2, 1024, DType::kFloat32,
       AttentionMode::kBlocked, true},
  };
  for (const Shape& shape : grid) {
    SCOPED_TRACE(shape.name);
    const double estimate = Estimate(shape);
    const double measured = MeasuredGrowth(shape);
    if (measured == kCannotResetPeak) {
      GTEST_SKIP() << "/proc/self/clear_refs cannot reset the peak RSS here";
    }
    std::printf("%-28s estimate %8.1f MiB measured %8.1f MiB ratio %.2f\n",
                shape.name, estimate / (1 << 20), measured / (1 << 20),
                estimate / measured);
    ASSERT_GT(measured, 0);
    EXPECT_GE(estimate, measured);
    EXPECT_LE(estimate, 1.5 * measured);
  }
}

}  // namespace
}  // namespace tally
