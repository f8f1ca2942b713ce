#include "runtime/train/call_plan.h"

#include <algorithm>
#include <utility>

#include "base/status.h"
#include "runtime/parallel/pipeline.h"
#include "runtime/train/context_parallel.h"

namespace tally {
namespace {

// The micro-batches (sample indices) of every data rank; only `mine` is
// kept, and the most any rank has.
size_t PlanBatchesOfRank(const std::vector<Sample>& samples,
                         const CallPlanOptions& options, int data_ranks,
                         int data_rank, std::vector<std::vector<int>>* mine) {
  const std::vector<std::vector<int>> assignment =
      PartitionSamples(samples, data_ranks);
  size_t most = 0;
  for (int r = 0; r < data_ranks; ++r) {
    std::vector<std::vector<int>> batches;
    for (const std::vector<int>& part :
         SplitContiguous(assignment[r], options.pipeline_parts)) {
      for (std::vector<int>& batch :
           PlanBatches(samples, part, options.max_batch_tokens)) {
        batches.push_back(std::move(batch));
      }
    }
    most = std::max(most, batches.size());
    if (r == data_rank) *mine = std::move(batches);
  }
  return most;
}

}  // namespace

torch::Tensor CallPlan::RowTokens(size_t b) const {
  if (!sample_tokens.defined() || !real(b)) return {};
  return sample_tokens
      .index({torch::tensor(packed[b].sample_index, torch::kInt64)})
      .to(packed[b].inputs.device(), torch::kInt64);
}

absl::StatusOr<CallPlan> PlanCall(const std::vector<Sample>& samples,
                                  const CallPlanOptions& options,
                                  Communicator& data, Communicator& cp) {
  std::vector<std::vector<int>> batches;
  const size_t num_batches =
      PlanBatchesOfRank(samples, options, data.size(), data.rank(), &batches);
  static const std::vector<Sample> kEmpty = {
      Sample{{0}, {kIgnoreIndex}, {}, {}}};
  const bool split_samples =
      cp.size() > 1 && options.reduction == LossReduction::kSampleMean;
  CallPlan plan;
  plan.real_batches = batches.size();
  if (split_samples) {
    plan.sample_tokens =
        torch::zeros({static_cast<int64_t>(samples.size())}, torch::kFloat64);
  }
  TALLY_RETURN_IF_ERROR(CatchTorch("pack micro-batches", [&] {
    for (size_t b = 0; b < num_batches; ++b) {
      PackedBatch batch = b < batches.size()
                              ? PackRows(samples, batches[b], options.dtype)
                              : PackRows(kEmpty, {0}, options.dtype);
      if (cp.size() > 1) {
        ContextParallelBatch split =
            SplitForContextParallel(batch, cp.rank(), cp.size());
        batch = std::move(split.local);
        plan.layouts.push_back(std::move(split.layout));
      } else {
        plan.layouts.push_back(
            AttentionLayout::RightPadded(batch.lengths, batch.inputs.size(1)));
      }
      if (split_samples && b < batches.size()) {
        plan.sample_tokens.index_put_(
            {torch::tensor(batch.sample_index, torch::kInt64)},
            batch.valid.sum(1).to(torch::kFloat64));
      }
      // Packed on the host, computed on the model's device.
      plan.layouts.back() = plan.layouts.back().To(options.device);
      plan.packed.push_back(batch.To(options.device));
    }
  }));
  // A cp rank holds only a part of each sample: T_b is the sum of the parts.
  if (split_samples) {
    TALLY_RETURN_IF_ERROR(cp.AllReduce(plan.sample_tokens, ReduceOp::kSum));
  }
  return plan;
}

}  // namespace tally
