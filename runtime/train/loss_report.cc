#include "runtime/train/loss_report.h"

#include <algorithm>

#include "runtime/train/loss.h"

namespace tally {
namespace {

// The statistics of one sample's valid tokens: `logprobs` [1, T] fp64 of
// `batch`, its one row packed in fp64.
PolicyStats MeasurePolicy(const TokenLoss& loss, const torch::Tensor& logprobs,
                          const PackedBatch& batch) {
  PolicyStats stats;
  const torch::Tensor valid = batch.valid;
  stats.tokens = valid.sum().item<int64_t>();
  if (stats.tokens == 0) return stats;
  const torch::Tensor gap =
      logprobs.masked_select(valid) -
      batch.token_inputs.at(kSamplingLogprobs).masked_select(valid);
  const torch::Tensor ratio = gap.exp();
  stats.ratio_mean = ratio.mean().item<double>();
  stats.ratio_min = ratio.min().item<double>();
  stats.ratio_max = ratio.max().item<double>();
  stats.clipped_fraction =
      loss.Clipped(ratio).to(torch::kFloat64).mean().item<double>();
  stats.logprob_gap_mean = gap.abs().mean().item<double>();
  stats.logprob_gap_max = gap.abs().max().item<double>();
  stats.kl_k1 = (-gap).mean().item<double>();
  stats.kl_k3 = (ratio - 1 - gap).mean().item<double>();
  return stats;
}

std::vector<double> ToVector(const torch::Tensor& row) {
  const torch::Tensor contiguous = row.contiguous();
  const double* data = contiguous.data_ptr<double>();
  return std::vector<double>(data, data + contiguous.numel());
}

}  // namespace

bool ReportsPolicy(const std::vector<Sample>& samples) {
  return std::all_of(samples.begin(), samples.end(), [](const Sample& s) {
    return s.token_inputs.count(kSamplingLogprobs) > 0;
  });
}

bool WantsLogprobs(const ForwardBackwardArgs& args) {
  return args.return_logprobs || ReportsPolicy(args.samples);
}

void ReportLoss(const TokenLoss& loss, const ForwardBackwardArgs& args,
                ForwardBackwardResult& result) {
  const bool policy = ReportsPolicy(args.samples);
  if (!policy && !args.return_logprobs) return;
  std::vector<PolicyStats> parts;
  for (size_t i = 0; i < args.samples.size(); ++i) {
    SampleResult& out = result.samples[i];
    const PackedBatch batch =
        PackRows(args.samples, {static_cast<int>(i)}, torch::kFloat64);
    const torch::Tensor logprobs =
        torch::tensor(out.logprobs, torch::kFloat64).unsqueeze(0);
    if (args.return_logprobs) {
      out.token_losses = ToVector(loss.TokenLosses(logprobs, batch)[0]);
    } else {
      out.logprobs.clear();
    }
    if (policy) {
      out.policy = MeasurePolicy(loss, logprobs, batch);
      parts.push_back(*out.policy);
    }
  }
  if (policy) result.policy = CombinePolicyStats(parts);
}

PolicyStats CombinePolicyStats(const std::vector<PolicyStats>& parts) {
  PolicyStats total;
  for (const PolicyStats& part : parts) {
    if (part.tokens == 0) continue;
    const double n = static_cast<double>(part.tokens);
    if (total.tokens == 0) {
      total.ratio_min = part.ratio_min;
      total.ratio_max = part.ratio_max;
    }
    total.tokens += part.tokens;
    total.ratio_mean += n * part.ratio_mean;
    total.ratio_min = std::min(total.ratio_min, part.ratio_min);
    total.ratio_max = std::max(total.ratio_max, part.ratio_max);
    total.clipped_fraction += n * part.clipped_fraction;
    total.logprob_gap_mean += n * part.logprob_gap_mean;
    total.logprob_gap_max =
        std::max(total.logprob_gap_max, part.logprob_gap_max);
    total.kl_k1 += n * part.kl_k1;
    total.kl_k3 += n * part.kl_k3;
  }
  if (total.tokens > 0) {
    const double n = static_cast<double>(total.tokens);
    for (double* mean : {&total.ratio_mean, &total.clipped_fraction,
                         &total.logprob_gap_mean, &total.kl_k1, &total.kl_k3}) {
      *mean /= n;
    }
  }
  return total;
}

}  // namespace tally
