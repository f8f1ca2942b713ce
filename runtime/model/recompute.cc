#include "runtime/model/recompute.h"

#include <torch/csrc/autograd/custom_function.h>

#include <utility>

namespace tally {
namespace {

// The block, held in the autograd context as an IValue capsule.
struct BlockHolder : torch::CustomClassHolder {
  explicit BlockHolder(TensorBlock f) : block(std::move(f)) {}
  TensorBlock block;
};

class Recompute : public torch::autograd::Function<Recompute> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& x,
                               c10::intrusive_ptr<BlockHolder> holder) {
    // Function::apply runs forward with autograd off: nothing is recorded.
    torch::Tensor y = holder->block(x);
    ctx->save_for_backward({x});
    ctx->saved_data["block"] = c10::IValue::make_capsule(std::move(holder));
    return y;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    const auto holder = c10::static_intrusive_pointer_cast<BlockHolder>(
        ctx->saved_data["block"].toCapsule());
    torch::Tensor x =
        ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode grad_mode(true);
      y = holder->block(x);
    }
    torch::autograd::backward({y}, {grad_outputs[0]});
    return {x.grad(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor RecomputeInBackward(TensorBlock block, const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled()) return block(x);  // no backward coming
  // An input outside the graph (a frozen embedding's output) would leave the
  // output outside it too, and the block's parameters without gradients.
  const torch::Tensor input =
      x.requires_grad() ? x : x.detach().requires_grad_(true);
  return Recompute::apply(input,
                          c10::make_intrusive<BlockHolder>(std::move(block)));
}

}  // namespace tally
