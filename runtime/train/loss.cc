#include "runtime/train/loss.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/config/loss_spec.h"

namespace tally {
namespace {

// Where token `t` of `s` counts (its target is not ignored, its weight not
// 0), its sampling_logprobs value, if it has one, must be a log-probability
// in [kMinSamplingLogprob, 0]. Elsewhere the losses never read it.
absl::Status CheckSamplingLogprob(const Sample& s, size_t t,
                                  const std::string& field) {
  const auto q = s.token_inputs.find(kSamplingLogprobs);
  if (q == s.token_inputs.end() || s.target_tokens[t] == kIgnoreIndex ||
      (!s.weights.empty() && s.weights[t] == 0)) {
    return absl::OkStatus();
  }
  const float value = q->second[t];
  if (value >= kMinSamplingLogprob && value <= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".", kSamplingLogprobs, "[", t, "] = ", value,
      " must be a log-probability in [", kMinSamplingLogprob, ", 0]"));
}

}  // namespace

absl::Status ValidateSamples(const LlamaConfig& config,
                             const std::vector<Sample>& samples) {
  if (samples.empty()) {
    return absl::InvalidArgumentError("samples must not be empty");
  }
  for (size_t i = 0; i < samples.size(); ++i) {
    const Sample& s = samples[i];
    const std::string field = absl::StrCat("samples[", i, "]");
    if (s.input_tokens.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".input_tokens must not be empty"));
    }
    if (s.target_tokens.size() != s.input_tokens.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".target_tokens has ", s.target_tokens.size(),
                       " tokens but input_tokens has ", s.input_tokens.size()));
    }
    if (!s.weights.empty() && s.weights.size() != s.input_tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".weights has ", s.weights.size(),
          " entries but input_tokens has ", s.input_tokens.size()));
    }
    for (const auto& [name, values] : s.token_inputs) {
      if (values.size() != s.input_tokens.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".", name, " has ", values.size(),
            " entries but input_tokens has ", s.input_tokens.size()));
      }
      for (size_t t = 0; t < values.size(); ++t) {
        if (!std::isfinite(values[t])) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, ".", name, "[", t, "] = ", values[t], " must be finite"));
        }
      }
    }
    if (static_cast<int64_t>(s.input_tokens.size()) >
        config.max_position_embeddings) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".input_tokens has ", s.input_tokens.size(),
                       " tokens, more than max_position_embeddings (",
                       config.max_position_embeddings, ")"));
    }
    for (size_t t = 0; t < s.input_tokens.size(); ++t) {
      const int32_t in = s.input_tokens[t], target = s.target_tokens[t];
      if (in < 0 || in >= config.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".input_tokens[", t, "] = ", in,
                         " is outside [0, ", config.vocab_size, ")"));
      }
      if (target != kIgnoreIndex &&
          (target < 0 || target >= config.vocab_size)) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".target_tokens[", t, "] = ", target, " is outside [0, ",
            config.vocab_size, ") and is not ", kIgnoreIndex));
      }
      if (!s.weights.empty() && !std::isfinite(s.weights[t])) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".weights[", t, "] = ", s.weights[t], " must be finite"));
      }
      TALLY_RETURN_IF_ERROR(CheckSamplingLogprob(s, t, field));
    }
  }
  return absl::OkStatus();
}

std::vector<std::vector<int>> PlanBatches(const std::vector<Sample>& samples,
                                          const std::vector<int>& indices,
                                          int64_t max_batch_tokens) {
  std::vector<int> order = indices;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return samples[a].input_tokens.size() > samples[b].input_tokens.size();
  });
  std::vector<std::vector<int>> batches;
  int64_t row_len = 0;  // the longest (first) row of the open batch
  for (int index : order) {
    const int64_t len =
        static_cast<int64_t>(samples[index].input_tokens.size());
    if (batches.empty() ||
        row_len * static_cast<int64_t>(batches.back().size() + 1) >
            max_batch_tokens) {
      batches.emplace_back();
      row_len = len;
    }
    batches.back().push_back(index);
  }
  return batches;
}

std::vector<std::vector<int>> PartitionSamples(
    const std::vector<Sample>& samples, int num_ranks) {
  std::vector<int64_t> valid(samples.size(), 0);
  for (size_t i = 0; i < samples.size(); ++i) {
    const Sample& s = samples[i];
    for (size_t t = 0; t < s.target_tokens.size(); ++t) {
      valid[i] += s.target_tokens[t] != kIgnoreIndex &&
                  (s.weights.empty() || s.weights[t] != 0);
    }
  }
  std::vector<int> order(samples.size());
  std::iota(order.begin(), order.end(), 0);
  // Most valid tokens first; equal counts by length, then index, so every
  // rank computes the same plan.
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (valid[a] != valid[b]) return valid[a] > valid[b];
    return samples[a].input_tokens.size() > samples[b].input_tokens.size();
  });
  std::vector<std::vector<int>> assignment(num_ranks);
  std::vector<int64_t> load(num_ranks, 0);
  for (int index : order) {
    const int rank = static_cast<int>(
        std::min_element(load.begin(), load.end()) - load.begin());
    assignment[rank].push_back(index);
    load[rank] += valid[index];
  }
  for (auto& rows : assignment) std::sort(rows.begin(), rows.end());
  return assignment;
}

LossTerms ComputeLoss(const torch::Tensor& target_logprobs,
                      const PackedBatch& batch, LossReduction reduction,
                      const torch::Tensor& sample_tokens) {
  return ComputeLoss(DefaultTokenLoss(), target_logprobs, batch, reduction,
                     sample_tokens);
}

LossTerms ComputeLoss(const TokenLoss& loss,
                      const torch::Tensor& target_logprobs,
                      const PackedBatch& batch, LossReduction reduction,
                      const torch::Tensor& sample_tokens) {
  LossTerms terms;
  torch::Tensor per_sample =
      loss.TokenLosses(target_logprobs, batch).sum(1);  // [B]
  const torch::Tensor valid_tokens = batch.valid.sum(1);
  // The per-sample results are read on the host.
  terms.sample_valid_tokens = valid_tokens.cpu();
  terms.sample_loss_sums = per_sample.detach().to(torch::kCPU, torch::kFloat64);
  terms.valid_tokens = terms.sample_valid_tokens.sum().item<int64_t>();
  if (reduction == LossReduction::kSampleMean) {
    const torch::Tensor& counts =
        sample_tokens.defined() ? sample_tokens : valid_tokens;
    // 1 / T_b for counted samples; samples with T_b = 0 contribute nothing.
    torch::Tensor inv_len = torch::where(
        counts > 0, 1.0 / counts.clamp_min(1).to(per_sample.scalar_type()),
        torch::zeros_like(per_sample));
    terms.raw_loss = (per_sample * inv_len).sum();
  } else {
    terms.raw_loss = per_sample.sum();
  }
  return terms;
}

}  // namespace tally
