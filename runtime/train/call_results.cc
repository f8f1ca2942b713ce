#include "runtime/train/call_results.h"

#include "absl/strings/str_cat.h"

namespace tally {

CallResults::CallResults(const std::vector<Sample>& samples,
                         bool return_logprobs, int64_t layers, int64_t experts)
    : samples_(samples),
      return_logprobs_(return_logprobs),
      layers_(layers),
      experts_(experts) {
  int64_t size = 2 * static_cast<int64_t>(samples.size());
  if (return_logprobs) {
    logprob_offset_.resize(samples.size());
    for (size_t i = 0; i < samples.size(); ++i) {
      logprob_offset_[i] = size;
      size += static_cast<int64_t>(samples[i].input_tokens.size());
    }
  }
  expert_offset_ = size;
  size += layers * experts;
  buffer_ = torch::zeros({size}, torch::kFloat64);
}

void CallResults::SetSample(int sample, double loss_sum, int64_t valid_tokens) {
  double* out = buffer_.data_ptr<double>();
  out[2 * sample] = loss_sum;
  out[2 * sample + 1] = static_cast<double>(valid_tokens);
}

void CallResults::SetLogprobs(int sample, const double* logprobs,
                              const int64_t* positions, int64_t count) {
  double* out = buffer_.data_ptr<double>() + logprob_offset_[sample];
  for (int64_t t = 0; t < count; ++t) out[positions[t]] = logprobs[t];
}

torch::Tensor CallResults::expert_tokens() {
  return buffer_.narrow(0, expert_offset_, layers_ * experts_);
}

absl::Status CallResults::SumOver(Communicator& group) {
  if (group.size() == 1) return absl::OkStatus();
  return group.AllReduce(buffer_, ReduceOp::kSum);
}

ForwardBackwardResult CallResults::Unpack(LossReduction reduction) const {
  const int num_samples = static_cast<int>(samples_.size());
  ForwardBackwardResult result;
  result.samples.resize(num_samples);
  const double* in = buffer_.data_ptr<double>();
  double sample_mean_sum = 0.0;
  for (int i = 0; i < num_samples; ++i) {
    SampleResult& out = result.samples[i];
    out.loss_sum = in[2 * i];
    out.valid_tokens = static_cast<int64_t>(in[2 * i + 1]);
    result.loss_sum += out.loss_sum;
    result.valid_tokens += out.valid_tokens;
    if (out.valid_tokens > 0) {
      ++result.num_samples;
      sample_mean_sum += out.loss_sum / out.valid_tokens;
    }
    if (return_logprobs_) {
      const double* row = in + logprob_offset_[i];
      out.logprobs.assign(row, row + samples_[i].input_tokens.size());
    }
  }
  if (reduction == LossReduction::kSampleMean) {
    result.loss_mean =
        result.num_samples > 0 ? sample_mean_sum / result.num_samples : 0.0;
  } else {
    result.loss_mean =
        result.valid_tokens > 0 ? result.loss_sum / result.valid_tokens : 0.0;
  }
  if (experts_ > 0) {
    const torch::Tensor load =
        buffer_.narrow(0, expert_offset_, layers_ * experts_)
            .view({layers_, experts_});
    const torch::Tensor per_expert = load.sum(0);
    for (int64_t e = 0; e < experts_; ++e) {
      result.metrics[absl::StrCat("expert_tokens_", e)] =
          per_expert[e].item<double>();
    }
    const torch::Tensor fraction =
        load / load.sum(1, /*keepdim=*/true).clamp_min(1.0);
    result.metrics["expert_load_min_fraction"] = fraction.min().item<double>();
    result.metrics["expert_load_max_fraction"] = fraction.max().item<double>();
  }
  return result;
}

}  // namespace tally
