#include "runtime/sample/prompt_logprobs.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/model/kv_cache.h"
#include "runtime/sample/mesh_decode.h"

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

// Per position of `prompt` but the last, in float64 on every stage: the
// next token's log-probability, then (topk > 0) the k most probable tokens'
// ids and log-probabilities, the lower id first among equals (a stable
// descending sort keeps id order among ties): [T - 1, 1 + 2k].
absl::StatusOr<torch::Tensor> ScorePrompt(CausalLm& model, MeshStep& step,
                                          const TokenIds& prompt,
                                          int64_t topk) {
  const int64_t length = static_cast<int64_t>(prompt.size());
  KvCache cache(model.config().num_hidden_layers, length);
  const torch::Tensor input = torch::tensor(prompt, kInt64).unsqueeze(0);
  const torch::Tensor positions = torch::arange(length, kInt64).unsqueeze(0);
  TALLY_ASSIGN_OR_RETURN(
      const torch::Tensor logits,
      step.Forward(input, positions, torch::ones({1, length}, torch::kBool),
                   cache));
  torch::Tensor rows;
  if (model.last_stage()) {
    // Position i predicts prompt[i + 1]; the last predicts nothing.
    const torch::Tensor all =
        torch::log_softmax(logits.squeeze(0), -1).narrow(0, 0, length - 1);
    const torch::Tensor next =
        torch::tensor(TokenIds(prompt.begin() + 1, prompt.end()), kInt64)
            .to(all.device());
    std::vector<torch::Tensor> columns = {all.gather(-1, next.unsqueeze(-1))};
    if (topk > 0) {
      const auto [values, ids] =
          all.sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true);
      columns.push_back(ids.narrow(-1, 0, topk));
      columns.push_back(values.narrow(-1, 0, topk));
    }
    for (torch::Tensor& column : columns) column = column.to(torch::kFloat64);
    rows = torch::cat(columns, /*dim=*/1);
  }
  return step.FromLastStage(rows, {length - 1, 1 + 2 * topk});
}

// ScorePrompt's rows as a PromptLogprobs.
PromptLogprobs Unpack(const torch::Tensor& rows, int64_t topk) {
  PromptLogprobs out;
  out.logprobs = ToDoubles(rows.select(1, 0));
  for (int64_t i = 0; topk > 0 && i < rows.size(0); ++i) {
    out.topk.push_back({ToInts(rows[i].narrow(0, 1, topk)),
                        ToDoubles(rows[i].narrow(0, 1 + topk, topk))});
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
    TALLY_RETURN_IF_ERROR(CheckTokenIds(
        prompts[i], absl::StrCat("prompts[", i, "].tokens"), vocab_size));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PromptLogprobs>> ComputePromptLogprobs(
    CausalLm& model, const std::vector<TokenIds>& prompts, int64_t topk,
    const DecodeGroups& groups) {
  const int64_t vocab = model.config().vocab_size;
  TALLY_RETURN_IF_ERROR(CheckPromptTokens(prompts, vocab));
  if (topk < 0 || topk > vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topk must be in [0, vocab_size = ", vocab, "], got ", topk));
  }
  // Every rank scores every prompt (no data split), so the forwards of
  // ranks that meet in collectives (tp, dp_shard, ep) stay in step.
  TALLY_ASSIGN_OR_RETURN(
      MeshStep step, MeshStep::Create(model, {nullptr, groups.pp, groups.all}));
  using Result = absl::StatusOr<std::vector<PromptLogprobs>>;
  return CatchTorch("prompt log-probabilities", [&]() -> Result {
    torch::NoGradGuard no_grad;
    std::vector<PromptLogprobs> out;
    for (size_t i = 0; i < prompts.size(); ++i) {
      // The ranks agree every kStopCheckSteps prompts whether to stop.
      if (i % kStopCheckSteps == 0) TALLY_RETURN_IF_ERROR(step.CheckStop());
      TALLY_ASSIGN_OR_RETURN(const torch::Tensor rows,
                             ScorePrompt(model, step, prompts[i], topk));
      out.push_back(Unpack(rows, topk));
    }
    return out;
  });
}

}  // namespace tally
