#include "runtime/parallel/pipeline_executor.h"

#include <optional>
#include <vector>

#include "base/status.h"
#include "runtime/parallel/pipeline.h"

namespace tally {
namespace {

void Check(const absl::Status& status) {
  TORCH_CHECK(status.ok(), status.ToString());
}

// The state of one stage's micro-batches while the schedule runs. A
// callback that throws becomes the stage's failure; from then on the stage
// runs no callback but keeps its transfers going (zeros in place of what it
// would have sent), so its neighbours finish their part. Transfers throw.
class StageRun {
 public:
  StageRun(Communicator& pp, size_t num_batches, bool backward,
           const StageCallbacks& callbacks)
      : pp_(pp),
        stage_(pp.rank()),
        first_(pp.rank() == 0),
        last_(pp.rank() == pp.size() - 1),
        backward_(backward),
        callbacks_(callbacks),
        inputs_(num_batches),
        outputs_(num_batches),
        output_grads_(num_batches) {}

  // OK until a callback failed on this stage (or an agreement said a peer
  // did).
  const absl::Status& failure() const { return failure_; }
  // What the ranks agree becomes this stage's failure.
  void Agree(const std::function<absl::Status(absl::Status)>& agree) {
    failure_ = agree(failure_);
  }

  // `next`: the step after this one, or null.
  void Forward(size_t b, const PipelineStep* next) {
    torch::Tensor input;
    if (!first_) {
      if (!inputs_[b].defined()) {
        inputs_[b] = callbacks_.boundary_like(b);
        Check(pp_.Recv(inputs_[b], stage_ - 1));
      }
      if (backward_) inputs_[b].requires_grad_(true);
      input = inputs_[b];
    }
    torch::Tensor output;
    Local([&] { output = callbacks_.forward(b, input); });
    if (!last_) {
      const torch::Tensor sent = failure_.ok() ? output.detach() : Zeros(b);
      if (next != nullptr && !next->forward) {
        const size_t n = static_cast<size_t>(next->micro_batch);
        output_grads_[n] = callbacks_.boundary_like(n);
        Check(pp_.SendRecv(sent, stage_ + 1, output_grads_[n], stage_ + 1));
      } else {
        Check(pp_.Send(sent, stage_ + 1));
      }
    }
    if (backward_) outputs_[b] = output;
  }

  void Backward(size_t b, const PipelineStep* next) {
    if (callbacks_.before_backward) {
      Local([&] { callbacks_.before_backward(b); });
    }
    if (!last_ && !output_grads_[b].defined()) {
      output_grads_[b] = callbacks_.boundary_like(b);
      Check(pp_.Recv(output_grads_[b], stage_ + 1));
    }
    Local([&] {
      if (last_) {
        outputs_[b].backward();
      } else if (!first_ || outputs_[b].requires_grad()) {
        // A first stage with nothing to train (a LoRA adapter of the head
        // only) has an output without a gradient to propagate.
        outputs_[b].backward(output_grads_[b]);
      }
    });
    if (!first_) {
      const torch::Tensor grad = failure_.ok() ? inputs_[b].grad() : Zeros(b);
      if (next != nullptr && next->forward) {
        const size_t n = static_cast<size_t>(next->micro_batch);
        inputs_[n] = callbacks_.boundary_like(n);
        Check(pp_.SendRecv(grad, stage_ - 1, inputs_[n], stage_ - 1));
      } else {
        Check(pp_.Send(grad, stage_ - 1));
      }
    }
    inputs_[b] = outputs_[b] = output_grads_[b] = torch::Tensor();
  }

 private:
  Communicator& pp_;
  const int stage_;
  const bool first_, last_, backward_;
  const StageCallbacks& callbacks_;
  absl::Status failure_;
  // Per micro-batch: the received input, the stage's output and, before
  // its backward, the output's gradient.
  std::vector<torch::Tensor> inputs_, outputs_, output_grads_;

  // Runs `fn` (a callback) unless the stage already failed.
  template <typename Fn>
  void Local(Fn&& fn) {
    if (!failure_.ok()) return;
    failure_ = CatchTorch("forward_backward", fn);
    if (!failure_.ok() && callbacks_.failed) callbacks_.failed(failure_);
  }
  torch::Tensor Zeros(size_t b) const {
    return callbacks_.boundary_like(b).zero_();
  }
};

}  // namespace

absl::Status RunStageSchedule(Communicator& pp, size_t num_batches,
                              bool backward, const StageCallbacks& callbacks) {
  std::vector<PipelineStep> steps;
  if (backward) {
    steps = OneForwardOneBackward(pp.rank(), pp.size(),
                                  static_cast<int>(num_batches));
  } else {
    for (size_t b = 0; b < num_batches; ++b) {
      steps.push_back({true, static_cast<int>(b)});
    }
  }
  // Every stage's last step is the backward of its last micro-batch.
  const size_t agreed_at =
      backward && callbacks.agree ? steps.size() - 1 : steps.size();
  absl::Status local;
  const absl::Status ran = CatchTorch("forward_backward", [&] {
    std::optional<torch::NoGradGuard> no_grad;
    if (!backward) no_grad.emplace();
    StageRun run(pp, num_batches, backward, callbacks);
    for (size_t i = 0; i < steps.size(); ++i) {
      if (i == agreed_at) run.Agree(callbacks.agree);
      const PipelineStep* next = i + 1 < steps.size() ? &steps[i + 1] : nullptr;
      const size_t b = static_cast<size_t>(steps[i].micro_batch);
      if (steps[i].forward) {
        run.Forward(b, next);
      } else {
        run.Backward(b, next);
      }
    }
    local = run.failure();
  });
  // A failed transfer; else this stage's failure.
  return ran.ok() ? local : ran;
}

}  // namespace tally
