#include "server/request_budget.h"

#include "absl/strings/str_cat.h"
#include "base/error_reason.h"

namespace tally {
namespace {

size_t Held(const std::map<std::string, size_t>& counts,
            const std::string& key) {
  auto it = counts.find(key);
  return it == counts.end() ? 0 : it->second;
}

void Give(std::map<std::string, size_t>& counts, const std::string& key) {
  auto it = counts.find(key);
  if (--it->second == 0) counts.erase(it);
}

}  // namespace

absl::Status RequestBudget::Acquire(const std::string& tenant,
                                    const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  if (total_ >= limits_.total) {
    return ReasonError(
        ErrorReason::kQueueFull,
        absl::StrCat("the server already holds ", total_,
                     " requests (--max-queued-requests); retry later"));
  }
  if (!tenant.empty() && Held(per_tenant_, tenant) >= limits_.per_tenant) {
    return ReasonError(
        ErrorReason::kQueueFull,
        absl::StrCat("the server already holds ", Held(per_tenant_, tenant),
                     " requests of this tenant "
                     "(--max-queued-requests-per-tenant); retry "
                     "later"));
  }
  if (!model_id.empty() && Held(per_model_, model_id) >= limits_.per_model) {
    return ReasonError(
        ErrorReason::kQueueFull,
        absl::StrCat("the server already holds ", Held(per_model_, model_id),
                     " requests for model '", model_id,
                     "' (--max-queued-requests-per-model); retry later"));
  }
  if (!tenant.empty()) ++per_tenant_[tenant];
  if (!model_id.empty()) ++per_model_[model_id];
  ++total_;
  return absl::OkStatus();
}

void RequestBudget::Release(const std::string& tenant,
                            const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  --total_;
  if (!tenant.empty()) Give(per_tenant_, tenant);
  if (!model_id.empty()) Give(per_model_, model_id);
}

bool RequestBudget::AcquireReserved(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  return reserved_.insert(model_id).second;
}

void RequestBudget::ReleaseReserved(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  reserved_.erase(model_id);
}

size_t RequestBudget::held() const {
  absl::MutexLock lock(&mu_);
  return total_ + reserved_.size();
}

}  // namespace tally
