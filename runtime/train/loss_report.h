// LossReport: what a ForwardBackward reports about its loss beyond the sums
// — each token's loss (Tinker's elementwise_loss) and, for samples carrying
// the sampler's log-probabilities, how far the trainer's policy is from the
// sampler's (PolicyStats).
//
// Both are functions of the call's per-token log-probabilities, which every
// rank holds once CallResults is summed, so they are computed from them in
// float64 after the call, identically on every rank and every mesh.
//
//   CallResults results(samples, WantsLogprobs(args), layers, experts);
//   ...
//   ForwardBackwardResult out = results.Unpack(reduction);
//   ReportLoss(loss, args, out);
#ifndef TALLY_RUNTIME_TRAIN_LOSS_REPORT_H_
#define TALLY_RUNTIME_TRAIN_LOSS_REPORT_H_

#include <vector>

#include "runtime/config/types.h"
#include "runtime/train/token_loss.h"

namespace tally {

// Whether the call reports policy statistics: all its samples carry
// sampling_logprobs.
bool ReportsPolicy(const std::vector<Sample>& samples);

// Whether the call needs its per-token log-probabilities gathered.
bool WantsLogprobs(const ForwardBackwardArgs& args);

// Fills each sample's token_losses (args.return_logprobs) and the samples'
// and the call's policy (ReportsPolicy) from result.samples[i].logprobs,
// then drops the log-probabilities unless args.return_logprobs.
void ReportLoss(const TokenLoss& loss, const ForwardBackwardArgs& args,
                ForwardBackwardResult& result);

// The statistics of several disjoint sets of tokens taken together.
PolicyStats CombinePolicyStats(const std::vector<PolicyStats>& parts);

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_LOSS_REPORT_H_
