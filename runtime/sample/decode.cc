#include "runtime/sample/decode.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/model/kv_cache.h"

namespace tally {
namespace {

const auto kInt64 = torch::TensorOptions().dtype(torch::kInt64);

// INVALID_ARGUMENT naming `field` when a token of `tokens` is out of range.
absl::Status CheckTokens(const std::vector<int64_t>& tokens,
                         const std::string& field, int64_t vocab_size) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  }
  for (size_t j = 0; j < tokens.size(); ++j) {
    if (tokens[j] < 0 || tokens[j] >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", j, "] = ", tokens[j],
                       " is not a token id in [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

bool EndsWith(const std::vector<int64_t>& tokens,
              const std::vector<int64_t>& suffix) {
  return tokens.size() >= suffix.size() &&
         std::equal(suffix.rbegin(), suffix.rend(), tokens.rbegin());
}

// The sequences still being decoded: their request indices, random streams
// and next positions, row by row of the cache.
struct ActiveRows {
  std::vector<int64_t> sequences;
  std::vector<torch::Generator> streams;
  std::vector<int64_t> positions;  // of the token each row feeds next

  // Keeps the rows whose `keep` is set; returns their indices.
  torch::Tensor Keep(const std::vector<bool>& keep) {
    std::vector<int64_t> rows;
    ActiveRows kept;
    for (size_t r = 0; r < keep.size(); ++r) {
      if (!keep[r]) continue;
      rows.push_back(static_cast<int64_t>(r));
      kept.sequences.push_back(sequences[r]);
      kept.streams.push_back(streams[r]);
      kept.positions.push_back(positions[r]);
    }
    *this = std::move(kept);
    return torch::tensor(rows, kInt64);
  }
};

// Runs the prompts, right-padded, through the model into `cache`; returns
// the logits [B, V] after each prompt's last token.
absl::StatusOr<torch::Tensor> Prefill(
    CausalLm& model, const std::vector<std::vector<int64_t>>& prompts,
    KvCache& cache) {
  const int64_t batch = static_cast<int64_t>(prompts.size());
  int64_t longest = 0;
  for (const auto& prompt : prompts) {
    longest = std::max(longest, static_cast<int64_t>(prompt.size()));
  }
  torch::Tensor input = torch::zeros({batch, longest}, kInt64);
  std::vector<int64_t> lengths;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = static_cast<int64_t>(prompts[b].size());
    input[b].narrow(0, 0, length).copy_(torch::tensor(prompts[b], kInt64));
    lengths.push_back(length);
  }
  const torch::Tensor last = torch::tensor(lengths, kInt64) - 1;
  const torch::Tensor positions =
      torch::arange(longest, kInt64).expand({batch, longest});
  const torch::Tensor valid = positions <= last.unsqueeze(1);
  TALLY_ASSIGN_OR_RETURN(
      torch::Tensor logits,
      model.ForwardWithCache(input, positions, valid, cache));
  const int64_t vocab = logits.size(2);
  return logits
      .gather(1, last.to(logits.device())
                     .view({batch, 1, 1})
                     .expand({batch, 1, vocab}))
      .squeeze(1);
}

}  // namespace

absl::Status ValidateDecodeRequest(const DecodeRequest& request,
                                   int64_t vocab_size) {
  if (request.prompts.empty()) {
    return absl::InvalidArgumentError("prompts is empty: nothing to sample");
  }
  for (size_t i = 0; i < request.prompts.size(); ++i) {
    TALLY_RETURN_IF_ERROR(CheckTokens(
        request.prompts[i], absl::StrCat("prompts[", i, "]"), vocab_size));
  }
  for (size_t i = 0; i < request.stop.size(); ++i) {
    TALLY_RETURN_IF_ERROR(CheckTokens(
        request.stop[i], absl::StrCat("stop[", i, "]"), vocab_size));
  }
  if (request.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens must be at least 1, got ", request.max_tokens));
  }
  return ValidateSamplingParams(request.sampling);
}

absl::StatusOr<std::vector<DecodedSequence>> Decode(
    CausalLm& model, const DecodeRequest& request) {
  TALLY_RETURN_IF_ERROR(
      ValidateDecodeRequest(request, model.config().vocab_size));
  return CatchTorch(
      "decoding", [&]() -> absl::StatusOr<std::vector<DecodedSequence>> {
        const int64_t batch = static_cast<int64_t>(request.prompts.size());
        ActiveRows active;
        int64_t longest = 0;
        for (int64_t b = 0; b < batch; ++b) {
          const int64_t length =
              static_cast<int64_t>(request.prompts[b].size());
          longest = std::max(longest, length);
          active.sequences.push_back(b);
          active.streams.push_back(SequenceGenerator(request.seed, b));
          active.positions.push_back(length);
        }
        KvCache cache(model.config().num_hidden_layers,
                      longest + request.max_tokens - 1);
        TALLY_ASSIGN_OR_RETURN(torch::Tensor logits,
                               Prefill(model, request.prompts, cache));
        std::vector<DecodedSequence> out(batch);
        while (true) {
          TALLY_ASSIGN_OR_RETURN(
              SampledTokens chosen,
              SampleTokens(logits, request.sampling, active.streams));
          const torch::Tensor tokens = chosen.tokens.cpu();
          const torch::Tensor logprobs = chosen.logprobs.cpu();
          std::vector<bool> keep;
          for (size_t r = 0; r < active.sequences.size(); ++r) {
            DecodedSequence& sequence = out[active.sequences[r]];
            sequence.tokens.push_back(tokens[r].item<int64_t>());
            sequence.logprobs.push_back(logprobs[r].item<double>());
            const bool stopped =
                std::any_of(request.stop.begin(), request.stop.end(),
                            [&](const std::vector<int64_t>& stop) {
                              return EndsWith(sequence.tokens, stop);
                            });
            if (stopped) sequence.stop_reason = StopReason::kStop;
            keep.push_back(!stopped &&
                           static_cast<int64_t>(sequence.tokens.size()) <
                               request.max_tokens);
          }
          const torch::Tensor rows = active.Keep(keep);
          if (active.sequences.empty()) return out;
          torch::Tensor next = tokens.index_select(0, rows);
          if (rows.size(0) < static_cast<int64_t>(keep.size())) {
            cache.KeepRows(rows);
          }
          const torch::Tensor positions =
              torch::tensor(active.positions, kInt64);
          for (int64_t& position : active.positions) ++position;
          TALLY_ASSIGN_OR_RETURN(
              logits, model.ForwardWithCache(
                          next.unsqueeze(1), positions.unsqueeze(1),
                          torch::ones({rows.size(0), 1}, torch::kBool), cache));
          logits = logits.squeeze(1);
        }
      });
}

}  // namespace tally
