#include "runtime/parallel/pipeline.h"

#include <algorithm>

namespace tally {

LayerRange StageLayers(int64_t num_layers, int stage, int stages) {
  const int64_t base = num_layers / stages, extra = num_layers % stages;
  LayerRange r;
  r.begin = stage * base + std::min<int64_t>(stage, extra);
  r.end = r.begin + base + (stage < extra ? 1 : 0);
  return r;
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
