#include "runtime/pipeline_executor.h"

#include <optional>
#include <vector>

#include "base/status.h"
#include "runtime/pipeline.h"

namespace tally {
namespace {

void Check(const absl::Status& status) {
  TORCH_CHECK(status.ok(), status.ToString());
}

// The state of one stage's micro-batches while the schedule runs.
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
    torch::Tensor output = callbacks_.forward(b, input);
    if (!last_) {
      if (next != nullptr && !next->forward) {
        const size_t n = static_cast<size_t>(next->micro_batch);
        output_grads_[n] = callbacks_.boundary_like(n);
        Check(pp_.SendRecv(output.detach(), stage_ + 1, output_grads_[n],
                           stage_ + 1));
      } else {
        Check(pp_.Send(output.detach(), stage_ + 1));
      }
    }
    if (backward_) outputs_[b] = output;
  }

  void Backward(size_t b, const PipelineStep* next) {
    if (callbacks_.before_backward) callbacks_.before_backward(b);
    if (last_) {
      outputs_[b].backward();
    } else {
      if (!output_grads_[b].defined()) {
        output_grads_[b] = callbacks_.boundary_like(b);
        Check(pp_.Recv(output_grads_[b], stage_ + 1));
      }
      // A first stage with nothing to train (a LoRA adapter of the head
      // only) has an output without a gradient to propagate.
      if (!first_ || outputs_[b].requires_grad()) {
        outputs_[b].backward(output_grads_[b]);
      }
    }
    if (!first_) {
      const torch::Tensor grad = inputs_[b].grad();
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
  // Per micro-batch: the received input, the stage's output and, before
  // its backward, the output's gradient.
  std::vector<torch::Tensor> inputs_, outputs_, output_grads_;
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
  return CatchTorch("forward_backward", [&] {
    std::optional<torch::NoGradGuard> no_grad;
    if (!backward) no_grad.emplace();
    StageRun run(pp, num_batches, backward, callbacks);
    for (size_t i = 0; i < steps.size(); ++i) {
      const PipelineStep* next = i + 1 < steps.size() ? &steps[i + 1] : nullptr;
      const size_t b = static_cast<size_t>(steps[i].micro_batch);
      if (steps[i].forward) {
        run.Forward(b, next);
      } else {
        run.Backward(b, next);
      }
    }
  });
}

}  // namespace tally
