// Pipeline parallelism: how the decoder layers split into stages and the
// 1F1B schedule each stage runs (which stage owns a parameter is the model
// family's to say: CausalLm::OwningStage).
//
// Stage 0 holds the embedding, the last stage the final norm and lm_head;
// the layers split into contiguous runs, the first L % P stages taking one
// layer more than the others. With tied embeddings the last stage holds a
// copy of the embedding (its lm_head) that stage 0 owns.
//
//   const tally::LayerRange r = tally::StageLayers(num_layers, stage, stages);
//   for (const tally::PipelineStep& s :
//        tally::OneForwardOneBackward(stage, stages, micro_batches)) {
//     if (s.forward) ... else ...
//   }
#ifndef TALLY_RUNTIME_PARALLEL_PIPELINE_H_
#define TALLY_RUNTIME_PARALLEL_PIPELINE_H_

#include <cstdint>
#include <vector>

namespace tally {

// Layers [begin, end) of one stage.
struct LayerRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// Requires 1 <= stages <= num_layers and 0 <= stage < stages.
LayerRange StageLayers(int64_t num_layers, int stage, int stages);

struct PipelineStep {
  bool forward = true;
  int micro_batch = 0;
};

// The non-interleaved 1F1B order of one stage: min(stages - stage - 1, M)
// warm-up forwards, then alternating forward / backward, then the remaining
// backwards. At most stages - stage micro-batches are in flight, whatever M.
std::vector<PipelineStep> OneForwardOneBackward(int stage, int stages,
                                                int micro_batches);

// `items` split into `chunks` contiguous runs of near-equal size (the first
// ones one longer); empty runs are dropped.
std::vector<std::vector<int>> SplitContiguous(const std::vector<int>& items,
                                              int chunks);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_PIPELINE_H_
