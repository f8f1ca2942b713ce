#include "runtime/engine/forward_backward.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "runtime/parallel/fault_hook.h"
#include "runtime/parallel/pipeline_executor.h"
#include "runtime/train/call_plan.h"
#include "runtime/train/call_results.h"
#include "runtime/train/gradient_sync.h"
#include "runtime/train/loss.h"
#include "runtime/train/loss_report.h"

namespace tally {
namespace {

// A last-stage micro-batch's per-sample results: loss sums and valid
// tokens, and (when `results` holds them) each token's log-probability, put
// back in sample order (a cp rank holds two chunks of each sample).
void RecordSamples(const torch::Tensor& logprobs, const PackedBatch& batch,
                   const AttentionLayout& layout, const LossTerms& terms,
                   CallResults& results) {
  const bool return_logprobs = results.with_logprobs();
  auto loss_sums = terms.sample_loss_sums.accessor<double, 1>();
  auto valid = terms.sample_valid_tokens.accessor<int64_t, 1>();
  torch::Tensor rows, positions;
  if (return_logprobs) {
    rows = logprobs.detach()
               .masked_fill(~batch.has_target, 0.0)
               .to(torch::kCPU, torch::kFloat64)
               .contiguous();
    positions = layout.positions.cpu().contiguous();
  }
  for (size_t r = 0; r < batch.sample_index.size(); ++r) {
    const int i = batch.sample_index[r];
    results.SetSample(i, loss_sums[r], valid[r]);
    if (return_logprobs) {
      results.SetLogprobs(i, rows[r].data_ptr<double>(),
                          positions[r].data_ptr<int64_t>(), batch.lengths[r]);
    }
  }
}

// The channels of `auxiliary` (see AuxiliaryLoss) in a stage boundary.
int64_t AuxiliaryChannels(const std::vector<AuxiliaryLoss>& auxiliary) {
  int64_t channels = 0;
  for (const AuxiliaryLoss& a : auxiliary) channels += a.channels;
  return channels;
}

// This stage's forward of micro-batch b. Between stages flow the hidden
// states [B, T, H] and the channels of the model's auxiliary losses, which
// the last stage turns into per-token terms joining each token's loss, so
// they are weighted and normalized exactly like the token's cross-entropy.
// Returns what the next stage receives or, on the last stage, the raw loss
// to backpropagate.
torch::Tensor ForwardMicroBatch(CausalLm& model, const CallPlan& plan, size_t b,
                                const torch::Tensor& received, bool last,
                                const ForwardBackwardArgs& args,
                                const TokenLoss& loss,
                                const std::vector<AuxiliaryLoss>& auxiliary,
                                CallResults& results) {
  const PackedBatch& batch = plan.packed[b];
  StageIo io;
  if (model.routed_experts() > 0) {
    const torch::Device device = batch.inputs.device();
    io.real_tokens = torch::arange(batch.inputs.size(1), batch.inputs.options())
                         .unsqueeze(0) <
                     torch::tensor(batch.lengths).to(device).unsqueeze(1);
    if (!plan.real(b)) io.real_tokens.fill_(false);
  }
  torch::Tensor input = batch.inputs;
  if (received.defined()) {
    int64_t offset = received.size(-1) - AuxiliaryChannels(auxiliary);
    input = received.narrow(-1, 0, offset);
    for (const AuxiliaryLoss& a : auxiliary) {
      io.auxiliary.push_back(received.narrow(-1, offset, a.channels));
      offset += a.channels;
    }
  }
  torch::Tensor output =
      model.StageForward(input, batch.targets, plan.layouts[b], &io);
  if (io.expert_tokens.defined()) {
    results.expert_tokens().add_(io.expert_tokens.flatten().cpu());
  }
  if (!last) {
    std::vector<torch::Tensor> sent = {output};
    sent.insert(sent.end(), io.auxiliary.begin(),
                io.auxiliary.begin() + auxiliary.size());
    return sent.size() == 1 ? output : torch::cat(sent, -1);
  }
  torch::Tensor loss_logprobs = output;
  const std::vector<torch::Tensor> auxiliary_terms =
      model.AuxiliaryTokenLosses(io);
  for (size_t a = 0; a < auxiliary_terms.size(); ++a) {
    loss_logprobs =
        loss_logprobs - auxiliary[a].coefficient * auxiliary_terms[a];
  }
  const LossTerms terms = ComputeLoss(loss, loss_logprobs, batch,
                                      args.reduction, plan.RowTokens(b));
  if (plan.real(b)) {
    RecordSamples(output, batch, plan.layouts[b], terms, results);
  }
  return terms.raw_loss;
}

// Whether `model`'s forward and backward run collectives inside a stage:
// tensor, context and expert parallelism, ZeRO-3's parameter gathers.
bool CommunicatesInThePass(const CausalLm& model) {
  const ModelSharding& sharding = model.sharding();
  return sharding.tp_size() > 1 || sharding.cp_size() > 1 ||
         sharding.ep_size() > 1 ||
         (sharding.dp_shard_size() > 1 &&
          sharding.zero_stage == ZeroStage::kParameters);
}

// Raises `status` as the exception a torch error would be, inside code that
// reports failures by throwing (the stage callbacks).
void ThrowIfError(const absl::Status& status) {
  TORCH_CHECK(status.ok(), status.ToString());
}

}  // namespace

absl::Status CheckAuxiliaryLossesApply(const CausalLm& model,
                                       const ForwardBackwardArgs& args) {
  if (model.auxiliary_losses().empty()) return absl::OkStatus();
  constexpr char kWhy[] =
      "is not implemented for a model with a router auxiliary loss "
      "(output_router_logits with router_aux_loss_coef > 0)";
  if (args.loss.name != LossSpec().name) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_fn ", args.loss.name, " ", kWhy,
                     "; use cross_entropy, or turn output_router_logits off"));
  }
  for (size_t i = 0; i < args.samples.size(); ++i) {
    const std::vector<float>& weights = args.samples[i].weights;
    for (size_t t = 0; t < weights.size(); ++t) {
      if (weights[t] >= 0) continue;
      return absl::InvalidArgumentError(
          absl::StrCat("samples[", i, "].weights[", t, "] = ", weights[t],
                       ": a negative weight ", kWhy));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ForwardBackwardResult> RunForwardBackwardPass(
    BuiltModel& built, const ForwardBackwardArgs& args, const TokenLoss& loss,
    const PassOptions& options) {
  const absl::Time start = absl::Now();
  CausalLm& model = built.model();
  const LlamaConfig& config = model.config();
  const EngineGroups& groups = built.rank().groups;
  const RankPhases& phases = built.rank().phases;
  CallPlanOptions plan_options;
  plan_options.reduction = args.reduction;
  plan_options.dtype = model.scalar_type();
  plan_options.pipeline_parts =
      options.pp_microbatches > 0 ? options.pp_microbatches : groups.pp->size();
  plan_options.max_batch_tokens = options.max_batch_tokens;
  plan_options.device = options.device;
  TALLY_ASSIGN_OR_RETURN(
      const CallPlan plan,
      PlanCall(args.samples, plan_options, *groups.data, *groups.cp));

  // This call's gradients are summed over the replicas on their own: the
  // earlier calls' are set aside meanwhile, and the sum may start during the
  // last backward.
  std::unique_ptr<CallGradientSum> call_sum;
  if (!args.forward_only && options.sum_call_gradients &&
      built.gradient_sync().needed()) {
    TALLY_ASSIGN_OR_RETURN(
        call_sum, built.gradient_sync().BeginCall(options.overlap_grad_sync));
  }

  CallResults results(args.samples, WantsLogprobs(args),
                      config.num_hidden_layers, model.routed_experts());
  const bool last = groups.pp->rank() == groups.pp->size() - 1;
  const std::vector<AuxiliaryLoss> auxiliary = model.auxiliary_losses();
  StageCallbacks stage;
  stage.boundary_like = [&](size_t b) {
    // Hidden states and a channel per auxiliary loss.
    const torch::Tensor& ids = plan.packed[b].inputs;
    const int64_t channels = config.hidden_size + AuxiliaryChannels(auxiliary);
    return torch::empty({ids.size(0), ids.size(1), channels},
                        ids.options().dtype(model.compute_type()));
  };
  stage.forward = [&](size_t b, const torch::Tensor& received) {
    ThrowIfError(InjectedFault(FaultPoint::kForward));
    return ForwardMicroBatch(model, plan, b, received, last, args, loss,
                             auxiliary, results);
  };
  stage.before_backward = [&](size_t b) {
    ThrowIfError(InjectedFault(FaultPoint::kBackward));
    // Earlier backwards only accumulate into what the last one sums.
    if (call_sum && b + 1 == plan.num_batches()) {
      call_sum->ArmForLastBackward();
    }
  };
  // Its peers may wait in a collective inside the pass that this rank will
  // not join. (Else the schedule's own agreements and transfers of zeros
  // let every rank finish, gradient sums in flight included.)
  if (CommunicatesInThePass(model)) {
    stage.failed = [&](const absl::Status& failure) {
      phases.FailFast(failure);
    };
  }
  // The last backward starts the gradient sums: its replicas agree first,
  // so that none starts a sum that a replica which failed would not join.
  if (call_sum && !call_sum->overlapped_groups().empty()) {
    stage.agree = [&](absl::Status so_far) {
      for (Communicator* group : call_sum->overlapped_groups()) {
        so_far = phases.AgreeUnlessFailed(*group, std::move(so_far));
      }
      return so_far;
    };
  }
  TALLY_RETURN_IF_ERROR(phases.Agree(RunStageSchedule(
      *groups.pp, plan.num_batches(), !args.forward_only, stage)));
  TALLY_RETURN_IF_ERROR(results.SumOver(*groups.data_and_cp));
  // Only the last stage computed the results (zeros elsewhere): every rank,
  // rank 0 on stage 0 included, gets the same numbers and normalizer.
  TALLY_RETURN_IF_ERROR(results.SumOver(*groups.pp));
  if (call_sum) TALLY_RETURN_IF_ERROR(call_sum->Finish());

  ForwardBackwardResult result = results.Unpack(args.reduction);
  ReportLoss(loss, args, result);
  int64_t padded_tokens = 0;
  for (size_t b = 0; b < plan.real_batches; ++b) {
    padded_tokens += plan.packed[b].inputs.numel();
  }
  result.metrics["micro_batches"] = static_cast<double>(plan.num_batches());
  result.metrics["padded_tokens"] = static_cast<double>(padded_tokens);
  result.metrics["seconds"] = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

}  // namespace tally
