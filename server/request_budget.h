// RequestBudget: bounds how many requests the server holds at once (waiting
// for their turn, queued or executing), overall, per tenant and per model, so
// a flood of requests is refused with RESOURCE_EXHAUSTED at once instead of
// growing memory without bound, and one tenant (holding requests behind a
// seq_id gap, say) cannot take the whole budget from the others. Each model
// also has one reserved slot beyond every limit, for the request its sequence
// waits for (its next seq_id): a full budget never refuses the one request
// that lets the model's waiting requests move.
//
//   tally::RequestBudget budget({/*total=*/1024, /*per_tenant=*/512,
//                                /*per_model=*/256});
//   TALLY_RETURN_IF_ERROR(budget.Acquire("alice", "alice/m"));  // or full
//   ...  // hold the request
//   budget.Release("alice", "alice/m");
//   if (budget.AcquireReserved("alice/m")) {  // the model's next seq_id
//     ...
//     budget.ReleaseReserved("alice/m");
//   }
#ifndef TALLY_SERVER_REQUEST_BUDGET_H_
#define TALLY_SERVER_REQUEST_BUDGET_H_

#include <cstddef>
#include <map>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace tally {

struct RequestBudgetLimits {
  size_t total = 1024;
  size_t per_tenant = 512;  // of authenticated tenants only
  size_t per_model = 256;
};

class RequestBudget {
 public:
  explicit RequestBudget(RequestBudgetLimits limits) : limits_(limits) {}

  // Takes a slot for a request of `tenant` ("": none, without
  // authentication) and `model_id` ("" for requests of no model); each
  // counts against its own limit and the total.
  absl::Status Acquire(const std::string& tenant, const std::string& model_id);
  // Gives back a slot Acquire granted.
  void Release(const std::string& tenant, const std::string& model_id);
  // Takes `model_id`'s reserved slot, which no limit counts: false while
  // it is taken. For the request the model's sequence waits for only, so
  // the server holds at most one such request per model beyond the limits.
  bool AcquireReserved(const std::string& model_id);
  // Gives back the slot AcquireReserved granted.
  void ReleaseReserved(const std::string& model_id);
  // Slots taken, reserved ones included.
  size_t held() const;

 private:
  const RequestBudgetLimits limits_;
  mutable absl::Mutex mu_;
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
  // Only tenants and models holding slots, so unknown ids cannot grow them.
  std::map<std::string, size_t> per_tenant_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, size_t> per_model_ ABSL_GUARDED_BY(mu_);
  // The models whose reserved slot is taken.
  std::set<std::string> reserved_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tally

#endif  // TALLY_SERVER_REQUEST_BUDGET_H_
