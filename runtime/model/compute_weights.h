// ComputeWeights: a mixed-precision model's compute-dtype (bfloat16) copies
// of its float32 masters, made once and reused by every forward — each
// ForwardBackward, each layer recomputed under activation checkpointing, each
// Sample and ComputeLogprobs forward — until the masters change; then the
// next use makes the copy again. A copy counts as current while its master
// is the same storage, the master's LibTorch version counter (bumped by
// every in-place operator, with or without autograd) has not moved, and the
// owner has not called Invalidate since: a writer that bypasses LibTorch's
// operators must bump the version (as the Optimizer does after its fused
// kernels) or have the owner call Invalidate (CausalLm::WeightsChanged).
//
// UseComputeCopy keeps training exact: the copy enters the graph as a
// function of its master whose backward casts the gradient to the master's
// dtype, which is what master.to(bfloat16)'s backward does; each use gets a
// node of its own, so a weight read twice still has each read's gradient
// widened before the two are added, as with a cast per use.
//
//   tally::ComputeWeights copies;
//   torch::Tensor w = tally::UseComputeCopy(
//       master, copies.CopyOf(index, master, torch::kBFloat16));
//   ... optimizer step through a fused kernel ...
//   copies.Invalidate();
#ifndef TALLY_RUNTIME_MODEL_COMPUTE_WEIGHTS_H_
#define TALLY_RUNTIME_MODEL_COMPUTE_WEIGHTS_H_

#include <torch/torch.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace tally {

class ComputeWeights {
 public:
  // The `compute` copy of `master` (the parameter tensor the caller numbers
  // `index`), without autograd: the kept one when current, else made now
  // (and kept). Thread-safe.
  torch::Tensor CopyOf(int index, const torch::Tensor& master,
                       torch::ScalarType compute);
  // Marks every kept copy stale; the memory stays until each is remade.
  void Invalidate();
  // The bytes of the copies kept, current or stale.
  int64_t bytes() const;

 private:
  struct Entry {
    torch::Tensor copy;
    uint64_t generation = 0;
    int64_t version = 0;
    const void* storage = nullptr;
  };

  mutable std::mutex mu_;
  std::vector<Entry> entries_;  // by index
  uint64_t generation_ = 0;
};

// `copy` (master's values in a lower precision) as a differentiable function
// of `master`: the gradient reaching it goes on to `master` cast to master's
// dtype. `copy` itself when autograd is off or `master` takes no gradient.
torch::Tensor UseComputeCopy(const torch::Tensor& master,
                             const torch::Tensor& copy);

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_COMPUTE_WEIGHTS_H_
