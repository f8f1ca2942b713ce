// RequestBudget: bounds how many requests the server holds at once (waiting
// for their turn, queued or executing), overall and per model, so a flood of
// requests is refused with RESOURCE_EXHAUSTED at once instead of growing
// memory without bound.
//
//   tally::RequestBudget budget(/*max_total=*/1024, /*max_per_model=*/256);
//   TALLY_RETURN_IF_ERROR(budget.Acquire("m"));  // RESOURCE_EXHAUSTED if full
//   ...  // hold the request
//   budget.Release("m");
#ifndef TALLY_SERVER_REQUEST_BUDGET_H_
#define TALLY_SERVER_REQUEST_BUDGET_H_

#include <cstddef>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace tally {

class RequestBudget {
 public:
  RequestBudget(size_t max_total, size_t max_per_model)
      : max_total_(max_total), max_per_model_(max_per_model) {}

  // Takes a slot for a request of `model_id` ("" for requests of no model,
  // which count only against the total).
  absl::Status Acquire(const std::string& model_id);
  // Gives back a slot Acquire granted.
  void Release(const std::string& model_id);
  size_t held() const;

 private:
  const size_t max_total_;
  const size_t max_per_model_;
  mutable absl::Mutex mu_;
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
  // Only models holding slots, so unknown ids cannot grow it.
  std::map<std::string, size_t> per_model_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tally

#endif  // TALLY_SERVER_REQUEST_BUDGET_H_
