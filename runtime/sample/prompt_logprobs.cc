#include "runtime/sample/prompt_logprobs.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/model/kv_cache.h"

namespace tally {
namespace {

const auto kInt64 = torch::TensorOptions().dtype(torch::kInt64);

std::vector<double> ToDoubles(const torch::Tensor& values) {
  const torch::Tensor wide = values.to(torch::kFloat64).contiguous().cpu();
  return std::vector<double>(wide.data_ptr<double>(),
                             wide.data_ptr<double>() + wide.numel());
}

std::vector<int64_t> ToInts(const torch::Tensor& values) {
  const torch::Tensor ints = values.to(torch::kInt64).contiguous().cpu();
  return std::vector<int64_t>(ints.data_ptr<int64_t>(),
                              ints.data_ptr<int64_t>() + ints.numel());
}

// The log-probabilities [T, V] of the token after each position of `prompt`.
absl::StatusOr<torch::Tensor> NextTokenLogprobs(CausalLm& model,
                                                const TokenIds& prompt) {
  const int64_t length = static_cast<int64_t>(prompt.size());
  KvCache cache(model.config().num_hidden_layers, length);
  const torch::Tensor input = torch::tensor(prompt, kInt64).unsqueeze(0);
  const torch::Tensor positions = torch::arange(length, kInt64).unsqueeze(0);
  TALLY_ASSIGN_OR_RETURN(
      const torch::Tensor logits,
      model.ForwardWithCache(input, positions,
                             torch::ones({1, length}, torch::kBool), cache));
  return torch::log_softmax(logits.squeeze(0), -1);
}

// The k most probable tokens of each row of `logprobs` [N, V], the lower id
// first among equals (a stable descending sort keeps id order among ties).
std::vector<TopkLogprobs> Topk(const torch::Tensor& logprobs, int64_t k) {
  const auto [values, ids] =
      logprobs.sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true);
  std::vector<TopkLogprobs> out;
  for (int64_t row = 0; row < logprobs.size(0); ++row) {
    out.push_back({ToInts(ids[row].narrow(0, 0, k)),
                   ToDoubles(values[row].narrow(0, 0, k))});
  }
  return out;
}

}  // namespace

absl::Status CheckPromptTokens(const std::vector<TokenIds>& prompts,
                               int64_t vocab_size) {
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompts[", i, "].tokens is empty"));
    }
    for (size_t j = 0; j < prompts[i].size(); ++j) {
      if (prompts[i][j] < 0 || prompts[i][j] >= vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("prompts[", i, "].tokens[", j, "] = ", prompts[i][j],
                         " is not a token id in [0, ", vocab_size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PromptLogprobs>> ComputePromptLogprobs(
    CausalLm& model, const std::vector<TokenIds>& prompts, int64_t topk) {
  const int64_t vocab = model.config().vocab_size;
  TALLY_RETURN_IF_ERROR(CheckPromptTokens(prompts, vocab));
  if (topk < 0 || topk > vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topk must be in [0, vocab_size = ", vocab, "], got ", topk));
  }
  return CatchTorch(
      "prompt log-probabilities",
      [&]() -> absl::StatusOr<std::vector<PromptLogprobs>> {
        torch::NoGradGuard no_grad;
        std::vector<PromptLogprobs> out;
        for (const TokenIds& prompt : prompts) {
          TALLY_ASSIGN_OR_RETURN(torch::Tensor all,
                                 NextTokenLogprobs(model, prompt));
          // Position i predicts prompt[i + 1]; the last predicts nothing.
          const int64_t scored = static_cast<int64_t>(prompt.size()) - 1;
          all = all.narrow(0, 0, scored);
          const torch::Tensor next =
              torch::tensor(TokenIds(prompt.begin() + 1, prompt.end()), kInt64)
                  .to(all.device());
          PromptLogprobs result;
          result.logprobs =
              ToDoubles(all.gather(-1, next.unsqueeze(-1)).squeeze(-1));
          if (topk > 0) result.topk = Topk(all, topk);
          out.push_back(std::move(result));
        }
        return out;
      });
}

}  // namespace tally
