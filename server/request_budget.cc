#include "server/request_budget.h"

#include "absl/strings/str_cat.h"

namespace tally {

absl::Status RequestBudget::Acquire(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  if (total_ >= max_total_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server already holds ", total_,
                     " requests (--max-queued-requests); retry later"));
  }
  if (!model_id.empty()) {
    auto it = per_model_.find(model_id);
    const size_t held = it == per_model_.end() ? 0 : it->second;
    if (held >= max_per_model_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the server already holds ", held, " requests for model '", model_id,
          "' (--max-queued-requests-per-model); retry later"));
    }
    ++per_model_[model_id];
  }
  ++total_;
  return absl::OkStatus();
}

void RequestBudget::Release(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  --total_;
  if (model_id.empty()) return;
  auto it = per_model_.find(model_id);
  if (--it->second == 0) per_model_.erase(it);
}

size_t RequestBudget::held() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

}  // namespace tally
