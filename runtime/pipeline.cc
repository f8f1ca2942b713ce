#include "runtime/pipeline.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"

namespace tally {

LayerRange StageLayers(int64_t num_layers, int stage, int stages) {
  const int64_t base = num_layers / stages, extra = num_layers % stages;
  LayerRange r;
  r.begin = stage * base + std::min<int64_t>(stage, extra);
  r.end = r.begin + base + (stage < extra ? 1 : 0);
  return r;
}

int OwningStage(const std::string& name, int64_t num_layers, int stages) {
  if (name == "model.embed_tokens.weight") return 0;
  if (name == "model.norm.weight" || name == "lm_head.weight") {
    return stages - 1;
  }
  constexpr char kPrefix[] = "model.layers.";
  if (!absl::StartsWith(name, kPrefix)) return -1;
  const size_t begin = sizeof(kPrefix) - 1;
  const size_t end = name.find('.', begin);
  int64_t layer;
  if (end == std::string::npos ||
      !absl::SimpleAtoi(name.substr(begin, end - begin), &layer) || layer < 0 ||
      layer >= num_layers) {
    return -1;
  }
  for (int s = 0; s < stages; ++s) {
    if (layer < StageLayers(num_layers, s, stages).end) return s;
  }
  return -1;
}

std::vector<PipelineStep> OneForwardOneBackward(int stage, int stages,
                                                int micro_batches) {
  const int warmup = std::min(stages - stage - 1, micro_batches);
  std::vector<PipelineStep> steps;
  int forward = 0, backward = 0;
  for (; forward < warmup; ++forward) steps.push_back({true, forward});
  for (; forward < micro_batches; ++forward, ++backward) {
    steps.push_back({true, forward});
    steps.push_back({false, backward});
  }
  for (; backward < micro_batches; ++backward) {
    steps.push_back({false, backward});
  }
  return steps;
}

std::vector<std::vector<int>> SplitContiguous(const std::vector<int>& items,
                                              int chunks) {
  std::vector<std::vector<int>> out;
  const size_t n = items.size(), base = n / chunks, extra = n % chunks;
  size_t at = 0;
  for (int c = 0; c < chunks; ++c) {
    const size_t size = base + (static_cast<size_t>(c) < extra ? 1 : 0);
    if (size == 0) continue;
    out.emplace_back(items.begin() + at, items.begin() + at + size);
    at += size;
  }
  return out;
}

}  // namespace tally
