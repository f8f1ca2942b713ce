#include "runtime/sample/mesh_decode.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace tally {
namespace {

const auto kFloat64 = torch::TensorOptions().dtype(torch::kFloat64);

// `local` as one float64 vector: per sequence its token count, stop reason,
// tokens and log-probabilities.
torch::Tensor Pack(const std::vector<DecodedSequence>& local) {
  std::vector<double> packed;
  for (const DecodedSequence& sequence : local) {
    packed.push_back(static_cast<double>(sequence.tokens.size()));
    packed.push_back(sequence.stop_reason == StopReason::kStop ? 1.0 : 0.0);
    for (int64_t token : sequence.tokens) {
      packed.push_back(static_cast<double>(token));
    }
    packed.insert(packed.end(), sequence.logprobs.begin(),
                  sequence.logprobs.end());
  }
  return torch::tensor(packed, kFloat64);
}

// Appends the `count` sequences Pack wrote into `packed` (contiguous,
// float64, on the host) to `out`.
void Unpack(const torch::Tensor& packed, int64_t count,
            std::vector<DecodedSequence>& out) {
  const double* at = packed.data_ptr<double>();
  for (int64_t i = 0; i < count; ++i) {
    DecodedSequence sequence;
    const auto length = static_cast<int64_t>(*at++);
    sequence.stop_reason =
        *at++ != 0.0 ? StopReason::kStop : StopReason::kLength;
    for (int64_t j = 0; j < length; ++j) {
      sequence.tokens.push_back(static_cast<int64_t>(*at++));
    }
    sequence.logprobs.assign(at, at + length);
    at += length;
    out.push_back(std::move(sequence));
  }
}

}  // namespace

absl::Status StoppedBecause(const absl::Status& own) {
  if (!own.ok()) return own;
  return absl::CancelledError(
      "stopped with the other ranks: rank 0's caller cancelled or its "
      "deadline passed");
}

SequenceBlock SequenceBlockOf(int64_t count, int rank, int size) {
  const int64_t base = count / size, longer = count % size;
  SequenceBlock block;
  block.begin = rank * base + std::min<int64_t>(rank, longer);
  block.end = block.begin + base + (rank < longer ? 1 : 0);
  return block;
}

absl::StatusOr<std::vector<DecodedSequence>> GatherDecoded(
    const std::vector<DecodedSequence>& local, int64_t count,
    Communicator& data, const torch::Device& device) {
  const torch::Tensor packed = Pack(local);
  const int64_t length = packed.numel();
  TALLY_ASSIGN_OR_RETURN(
      torch::Tensor lengths,
      data.AllGather(
          torch::full({1}, static_cast<double>(length), kFloat64).to(device)));
  lengths = lengths.cpu();
  const auto longest = static_cast<int64_t>(lengths.max().item<double>());
  torch::Tensor padded = torch::zeros({longest}, kFloat64);
  padded.narrow(0, 0, length).copy_(packed);
  TALLY_ASSIGN_OR_RETURN(torch::Tensor all, data.AllGather(padded.to(device)));
  all = all.cpu().contiguous();
  std::vector<DecodedSequence> out;
  out.reserve(count);
  for (int r = 0; r < data.size(); ++r) {
    const SequenceBlock block = SequenceBlockOf(count, r, data.size());
    Unpack(all.narrow(0, r * longest, longest), block.end - block.begin, out);
  }
  return out;
}

absl::StatusOr<MeshStep> MeshStep::Create(CausalLm& model,
                                          const DecodeGroups& groups) {
  const ModelSharding& sharding = model.sharding();
  if (sharding.pp_stages > 1 && groups.pp == nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "decoding pipeline stage ", sharding.pp_stage, " of ",
        sharding.pp_stages, " needs its pipeline: pass groups.pp"));
  }
  if (sharding.pp_stages > 1 && (groups.pp->size() != sharding.pp_stages ||
                                 groups.pp->rank() != sharding.pp_stage)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "groups.pp must be the pipeline of this stage (", sharding.pp_stage,
        " of ", sharding.pp_stages, " stages), got rank ", groups.pp->rank(),
        " of ", groups.pp->size()));
  }
  const bool split = groups.data != nullptr && groups.data->size() > 1;
  const bool collectives =
      sharding.dp_shard_size() > 1 || sharding.ep_size() > 1;
  return MeshStep(model, groups, split && collectives);
}

absl::StatusOr<torch::Tensor> MeshStep::Forward(
    const torch::Tensor& tokens, const torch::Tensor& positions,
    const torch::Tensor& valid, KvCache& cache,
    const torch::Tensor& logits_at) {
  torch::Tensor input = tokens;
  const int stage = model_->pp_stage();
  if (!model_->first_stage()) {
    input = torch::empty(
        {tokens.size(0), tokens.size(1), model_->config().hidden_size},
        torch::TensorOptions()
            .dtype(model_->compute_type())
            .device(model_->device()));
    TALLY_RETURN_IF_ERROR(groups_.pp->Recv(input, stage - 1));
  }
  TALLY_ASSIGN_OR_RETURN(
      torch::Tensor out,
      model_->ForwardWithCache(input, positions, valid, cache, logits_at));
  if (model_->last_stage()) return out;
  TALLY_RETURN_IF_ERROR(groups_.pp->Send(out.contiguous(), stage + 1));
  return torch::Tensor();
}

absl::StatusOr<SampledTokens> MeshStep::Share(const SampledTokens& chosen,
                                              int64_t rows) {
  if (model_->sharding().pp_stages == 1) return chosen;
  // Token ids are exact in float64: one broadcast carries both rows.
  TALLY_ASSIGN_OR_RETURN(
      torch::Tensor both,
      FromLastStage(model_->last_stage()
                        ? torch::stack({chosen.tokens.to(torch::kFloat64),
                                        chosen.logprobs.to(torch::kFloat64)})
                        : torch::Tensor(),
                    {2, rows}));
  return SampledTokens{both[0].to(torch::kInt64), both[1]};
}

absl::StatusOr<torch::Tensor> MeshStep::FromLastStage(
    const torch::Tensor& on_last, at::IntArrayRef shape) {
  if (model_->sharding().pp_stages == 1) return on_last;
  torch::Tensor out =
      model_->last_stage()
          ? on_last.to(model_->device(), torch::kFloat64).contiguous()
          : torch::empty(shape, kFloat64.device(model_->device()));
  TALLY_RETURN_IF_ERROR(
      groups_.pp->Broadcast(out, model_->sharding().pp_stages - 1));
  return out;
}

absl::StatusOr<StepAgreement> MeshStep::Agree(bool decoding, bool stop,
                                              bool check) {
  Communicator* group = nullptr;
  if (check && groups_.all != nullptr && groups_.all->size() > 1) {
    group = groups_.all;
  } else if (lockstep_) {
    group = groups_.data;
  }
  if (group == nullptr) return StepAgreement{decoding, stop};
  torch::Tensor flags =
      torch::tensor({decoding ? 1.0 : 0.0, stop ? 1.0 : 0.0}, kFloat64)
          .to(model_->device());
  TALLY_RETURN_IF_ERROR(group->AllReduce(flags, ReduceOp::kMax));
  flags = flags.cpu();
  return StepAgreement{flags[0].item<double>() > 0,
                       flags[1].item<double>() > 0};
}

absl::Status MeshStep::CheckStop() {
  const absl::Status own = PollStop(ScopedDecodeControl::Current());
  TALLY_ASSIGN_OR_RETURN(const StepAgreement agreed,
                         Agree(/*decoding=*/true, !own.ok(), /*check=*/true));
  return agreed.stop ? StoppedBecause(own) : absl::OkStatus();
}

absl::Status MeshStep::Idle() {
  KvCache scratch(model_->config().num_hidden_layers, /*capacity=*/1);
  const auto int64 = torch::TensorOptions().dtype(torch::kInt64);
  const torch::Tensor input =
      model_->first_stage()
          ? torch::zeros({1, 1}, int64)
          : torch::zeros({1, 1, model_->config().hidden_size},
                         torch::TensorOptions().dtype(model_->compute_type()));
  return model_
      ->ForwardWithCache(input, torch::zeros({1, 1}, int64),
                         torch::ones({1, 1}, torch::kBool), scratch,
                         /*logits_at=*/torch::Tensor())
      .status();
}

}  // namespace tally
