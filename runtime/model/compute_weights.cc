#include "runtime/model/compute_weights.h"

namespace tally {
namespace {

// The copy passes through; its gradient is widened to the master's dtype.
class CastOnce : public torch::autograd::Function<CastOnce> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& master,
                               const torch::Tensor& copy) {
    ctx->saved_data["dtype"] = master.scalar_type();
    return copy;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const torch::ScalarType dtype = ctx->saved_data["dtype"].toScalarType();
    return {grads[0].to(dtype), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor ComputeWeights::CopyOf(int index, const torch::Tensor& master,
                                     torch::ScalarType compute) {
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<size_t>(index) >= entries_.size()) {
    entries_.resize(index + 1);
  }
  Entry& entry = entries_[index];
  const void* storage = master.storage().unsafeGetStorageImpl();
  if (entry.copy.defined() && entry.generation == generation_ &&
      entry.version == master._version() && entry.storage == storage &&
      entry.copy.device() == master.device()) {
    return entry.copy;
  }
  torch::NoGradGuard no_grad;
  entry.copy = torch::Tensor();  // the stale copy goes before the new comes
  entry.copy = master.to(compute);
  entry.generation = generation_;
  entry.version = master._version();
  entry.storage = storage;
  return entry.copy;
}

void ComputeWeights::Invalidate() {
  std::lock_guard<std::mutex> lock(mu_);
  ++generation_;
}

int64_t ComputeWeights::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const Entry& entry : entries_) {
    if (entry.copy.defined())
      total += static_cast<int64_t>(entry.copy.nbytes());
  }
  return total;
}

torch::Tensor UseComputeCopy(const torch::Tensor& master,
                             const torch::Tensor& copy) {
  if (!torch::GradMode::is_enabled() || !master.requires_grad()) return copy;
  return CastOnce::apply(master, copy);
}

}  // namespace tally
