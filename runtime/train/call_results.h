// CallResults: what one ForwardBackward call reports, gathered from the
// ranks that computed it.
//
// One flat fp64 buffer holds, per sample, its raw loss sum and valid-token
// count, then (with return_logprobs) every sample's per-token logprobs, then
// (for a mixture-of-experts model) the real tokens routed to each expert of
// each layer. Only the ranks that own a value write it — the last pipeline
// stage, each cp rank its own tokens, each data rank its samples — and every
// other entry stays zero, so summing the buffer over the ranks holding
// distinct tokens, then over the pipeline stages, gives every rank the whole
// result with one collective per group.
//
//   tally::CallResults results(samples, return_logprobs, layers, experts);
//   results.SetSample(i, loss_sum, valid_tokens);      // owners only
//   TALLY_RETURN_IF_ERROR(results.SumOver(data_and_cp));
//   tally::ForwardBackwardResult out = results.Unpack(reduction);
#ifndef TALLY_RUNTIME_TRAIN_CALL_RESULTS_H_
#define TALLY_RUNTIME_TRAIN_CALL_RESULTS_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "runtime/config/types.h"
#include "runtime/parallel/communicator.h"

namespace tally {

class CallResults {
 public:
  // `samples` must outlive it. experts = 0 for a dense model.
  CallResults(const std::vector<Sample>& samples, bool return_logprobs,
              int64_t layers, int64_t experts);

  // Whether the buffer holds the per-token log-probabilities.
  bool with_logprobs() const { return return_logprobs_; }

  void SetSample(int sample, double loss_sum, int64_t valid_tokens);
  // logprobs[t] of the sample's token at positions[t], for t < count (a cp
  // rank holds its tokens out of order).
  void SetLogprobs(int sample, const double* logprobs, const int64_t* positions,
                   int64_t count);
  // [layers * experts] fp64, to add a micro-batch's routed token counts to.
  torch::Tensor expert_tokens();

  absl::Status SumOver(Communicator& group);

  // Per-sample results and totals; loss_mean under `reduction`; for a MoE
  // model the expert-load metrics: tokens per expert (summed over layers)
  // and the least and most loaded expert of any layer as a fraction of that
  // layer's assignments (1 / E when balanced).
  ForwardBackwardResult Unpack(LossReduction reduction) const;

 private:
  const std::vector<Sample>& samples_;
  const bool return_logprobs_;
  const int64_t layers_, experts_;
  std::vector<int64_t> logprob_offset_;  // per sample, with return_logprobs
  int64_t expert_offset_ = 0;
  torch::Tensor buffer_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_CALL_RESULTS_H_
