#include "runtime/sample/decode.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "runtime/model/kv_cache.h"
#include "runtime/sample/mesh_decode.h"
#include "runtime/sample/sampling.h"

namespace tally {
namespace {

const auto kInt64 = torch::TensorOptions().dtype(torch::kInt64);

// INVALID_ARGUMENT naming `field` when a token of `tokens` is out of range.
absl::Status CheckTokens(const std::vector<int64_t>& tokens,
                         const std::string& field, int64_t vocab_size) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  }
  return CheckTokenIds(tokens, field, vocab_size);
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

// Runs the prompts, right-padded, through this stage into `cache`; returns
// the logits [B, V] after each prompt's last token on the last stage (an
// undefined tensor on the others).
absl::StatusOr<torch::Tensor> Prefill(
    MeshStep& step, const std::vector<std::vector<int64_t>>& prompts,
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
      step.Forward(input, positions, valid, cache, /*logits_at=*/last));
  return logits.defined() ? logits.squeeze(1) : logits;
}

// One rank's sequences [block.begin, block.end) being decoded: the rows of
// its cache and what each row's sequence has so far.
struct BlockDecode {
  const DecodeRequest& request;
  SequenceBlock block;
  ActiveRows active;
  std::vector<DecodedSequence> out;  // by sequence - block.begin
};

// Chooses each active row's token from `logits` (on the last stage; the
// others receive them), appends it to its sequence and drops the rows that
// stopped, from the cache too; returns the kept rows' tokens [B'].
absl::StatusOr<torch::Tensor> ChooseTokens(MeshStep& step,
                                           const torch::Tensor& logits,
                                           BlockDecode& decode,
                                           KvCache& cache) {
  const DecodeRequest& request = decode.request;
  ActiveRows& active = decode.active;
  const auto rows_before = static_cast<int64_t>(active.sequences.size());
  SampledTokens chosen;
  if (logits.defined()) {
    TALLY_ASSIGN_OR_RETURN(
        chosen, SampleTokens(logits, request.sampling, active.streams));
  }
  TALLY_ASSIGN_OR_RETURN(chosen, step.Share(chosen, rows_before));
  const torch::Tensor tokens = chosen.tokens.cpu();
  const torch::Tensor logprobs = chosen.logprobs.cpu();
  std::vector<bool> keep;
  for (int64_t r = 0; r < rows_before; ++r) {
    DecodedSequence& sequence =
        decode.out[active.sequences[r] - decode.block.begin];
    sequence.tokens.push_back(tokens[r].item<int64_t>());
    sequence.logprobs.push_back(logprobs[r].item<double>());
    const bool stopped = std::any_of(request.stop.begin(), request.stop.end(),
                                     [&](const std::vector<int64_t>& stop) {
                                       return EndsWith(sequence.tokens, stop);
                                     });
    if (stopped) sequence.stop_reason = StopReason::kStop;
    keep.push_back(!stopped && static_cast<int64_t>(sequence.tokens.size()) <
                                   request.max_tokens);
  }
  const torch::Tensor rows = active.Keep(keep);
  if (!active.sequences.empty() && rows.size(0) < rows_before) {
    cache.KeepRows(rows);
  }
  return tokens.index_select(0, rows);
}

// The current thread's DecodeControl (decode_control.h), polled and
// reported to at each step.
class StepControl {
 public:
  StepControl()
      : control_(ScopedDecodeControl::Current()), last_(absl::Now()) {}

  // At a check step, why this rank wants to stop (OK: it does not).
  absl::Status Poll(bool check) const {
    return check ? PollStop(control_) : absl::OkStatus();
  }
  // After a step that chose the `step`-th token of each active sequence;
  // done: the final report.
  void Report(const ActiveRows& active, const KvCache& cache, int64_t step,
              bool done) {
    if (control_ == nullptr || !control_->on_progress) return;
    const absl::Time now = absl::Now();
    DecodeStats stats;
    stats.active_sequences =
        done ? 0 : static_cast<int64_t>(active.sequences.size());
    stats.cache_bytes = done || active.sequences.empty() ? 0 : cache.bytes();
    stats.step = done ? 0 : step;
    stats.step_seconds = absl::ToDoubleSeconds(now - last_);
    stats.done = done;
    last_ = now;
    control_->on_progress(stats);
  }

 private:
  const DecodeControl* control_;
  absl::Time last_;
};

// A rank with nothing left whose forwards meet no other data rank's: it
// joins the others' stop checks until none decodes (the result) or they
// stop (the error).
absl::Status JoinChecksUntilDone(MeshStep& step, const StepControl& control) {
  while (true) {
    const absl::Status own = control.Poll(/*check=*/true);
    TALLY_ASSIGN_OR_RETURN(
        const StepAgreement agreed,
        step.Agree(/*decoding=*/false, !own.ok(), /*check=*/true));
    if (agreed.stop) return StoppedBecause(own);
    if (!agreed.more) return absl::OkStatus();
  }
}

// Starts `decode` on this rank's block: its rows, their streams and
// positions; returns the longest prompt.
int64_t StartBlock(BlockDecode& decode,
                   std::vector<std::vector<int64_t>>& prompts) {
  int64_t longest = 0;
  for (int64_t b = decode.block.begin; b < decode.block.end; ++b) {
    const std::vector<int64_t>& prompt = decode.request.prompts[b];
    prompts.push_back(prompt);
    const auto length = static_cast<int64_t>(prompt.size());
    longest = std::max(longest, length);
    decode.active.sequences.push_back(b);
    decode.active.streams.push_back(SequenceGenerator(decode.request.seed, b));
    decode.active.positions.push_back(length);
  }
  decode.out.resize(decode.block.end - decode.block.begin);
  return longest;
}

// Decodes this rank's block of the request's sequences, in step with the
// other ranks of the mesh (`step`). Every kStopCheckSteps steps the ranks
// agree whether to stop (the current DecodeControl's stop, on rank 0); a
// stopped decode returns why, having changed nothing but its own cache.
absl::StatusOr<std::vector<DecodedSequence>> DecodeBlock(
    CausalLm& model, const DecodeRequest& request, SequenceBlock block,
    MeshStep& step) {
  StepControl control;
  BlockDecode decode{request, block, {}, {}};
  std::vector<std::vector<int64_t>> prompts;
  const int64_t longest = StartBlock(decode, prompts);
  ActiveRows& active = decode.active;
  KvCache cache(model.config().num_hidden_layers,
                longest + request.max_tokens - 1);
  torch::Tensor logits;
  if (!prompts.empty()) {
    TALLY_ASSIGN_OR_RETURN(logits, Prefill(step, prompts, cache));
  } else if (step.lockstep()) {
    TALLY_RETURN_IF_ERROR(step.Idle());
  }
  absl::Cleanup report_done = [&] { control.Report(active, cache, 0, true); };
  for (int64_t iteration = 0;; ++iteration) {
    torch::Tensor next;
    if (!active.sequences.empty()) {
      TALLY_ASSIGN_OR_RETURN(next, ChooseTokens(step, logits, decode, cache));
      control.Report(active, cache, iteration + 1, /*done=*/false);
    }
    if (active.sequences.empty() && !step.lockstep()) {
      TALLY_RETURN_IF_ERROR(JoinChecksUntilDone(step, control));
      return std::move(decode.out);
    }
    const bool check = iteration % kStopCheckSteps == 0;
    const absl::Status own = control.Poll(check);
    TALLY_ASSIGN_OR_RETURN(
        const StepAgreement agreed,
        step.Agree(!active.sequences.empty(), !own.ok(), check));
    if (agreed.stop) return StoppedBecause(own);
    if (!agreed.more) return std::move(decode.out);
    if (active.sequences.empty()) {
      TALLY_RETURN_IF_ERROR(step.Idle());
      continue;
    }
    const torch::Tensor positions = torch::tensor(active.positions, kInt64);
    for (int64_t& position : active.positions) ++position;
    TALLY_ASSIGN_OR_RETURN(
        logits,
        step.Forward(next.unsqueeze(1), positions.unsqueeze(1),
                     torch::ones({next.size(0), 1}, torch::kBool), cache));
    if (logits.defined()) logits = logits.squeeze(1);
  }
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
  return Decode(model, request, DecodeGroups());
}

absl::StatusOr<std::vector<DecodedSequence>> Decode(
    CausalLm& model, const DecodeRequest& request, const DecodeGroups& groups) {
  TALLY_RETURN_IF_ERROR(
      ValidateDecodeRequest(request, model.config().vocab_size));
  TALLY_ASSIGN_OR_RETURN(MeshStep step, MeshStep::Create(model, groups));
  const auto count = static_cast<int64_t>(request.prompts.size());
  const bool split = groups.data != nullptr && groups.data->size() > 1;
  const SequenceBlock block =
      split ? SequenceBlockOf(count, groups.data->rank(), groups.data->size())
            : SequenceBlock{0, count};
  return CatchTorch(
      "decoding", [&]() -> absl::StatusOr<std::vector<DecodedSequence>> {
        TALLY_ASSIGN_OR_RETURN(std::vector<DecodedSequence> local,
                               DecodeBlock(model, request, block, step));
        if (!split) return local;
        return GatherDecoded(local, count, *groups.data, model.device());
      });
}

}  // namespace tally
