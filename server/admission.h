// MemoryAdmission: the server's ledger of the memory its models hold, by the
// estimates of runtime/config/memory_estimate.h, so that a model or a call that
// would not fit is refused with RESOURCE_EXHAUSTED before anything is
// allocated, instead of the process being OOM-killed with every tenant's
// state.
//
// A model holds its resident bytes (parameters, gradients, optimizer state)
// from creation to deletion, against --max-memory-bytes and its tenant's
// --max-memory-bytes-per-tenant, and so does each of its sampler snapshots
// (SamplerSnapshotBytes, charged to the model's tenant) until it is deleted;
// a ForwardBackward's activations must fit in what the resident models
// leave (calls run one at a time). Used on the executor thread, where
// creations and deletions are ordered.
//
//   tally::MemoryAdmission admission({/*limit=*/8e9, /*per_tenant=*/0});
//   TALLY_RETURN_IF_ERROR(admission.CheckModel("alice", bytes));
//   ... create it ...
//   admission.Add("alice/m", "alice", bytes);
//   TALLY_RETURN_IF_ERROR(admission.CheckCall(activation_bytes));
//   admission.Remove("alice/m");  // deleted
//   TALLY_RETURN_IF_ERROR(admission.CheckSnapshot("alice", snapshot_bytes));
//
// On a CUDA rank the limit is the device's (DeviceMemoryLimit): what was free
// at start plus what the caching allocator holds unused, less a margin.
//
//   const tally::MemoryLimit limit = tally::DeviceMemoryLimit(
//       {"cuda:0", free, total, reserved, allocated}, flag_bytes);
#ifndef TALLY_SERVER_ADMISSION_H_
#define TALLY_SERVER_ADMISSION_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "runtime/config/types.h"

namespace tally {

struct MemoryAdmissionOptions {
  double limit_bytes = 0;  // 0: no limit
  // What the limit is, in refusals ("... of the 70 GiB of <limit_name> are
  // left").
  std::string limit_name = "--max-memory-bytes";
  double per_tenant_bytes = 0;  // 0: no quota per tenant
  // Observers (metrics): the resident total after every Add and Remove, and
  // "model" or "call" at every refusal. Called under the ledger's lock.
  std::function<void(double resident_bytes)> on_resident;
  std::function<void(const char* refused)> on_refusal;
};

class MemoryAdmission {
 public:
  explicit MemoryAdmission(MemoryAdmissionOptions options)
      : options_(options) {}

  // RESOURCE_EXHAUSTED naming the flag, the estimate and what is left when a
  // new model of `tenant` ("" without authentication) of `bytes` does not
  // fit.
  absl::Status CheckModel(const std::string& tenant, double bytes) const;
  // The same for a new sampler snapshot of one of `tenant`'s models.
  absl::Status CheckSnapshot(const std::string& tenant, double bytes) const;
  void Add(const std::string& model_id, const std::string& tenant,
           double bytes);
  void Remove(const std::string& model_id);
  // RESOURCE_EXHAUSTED when a call's activations do not fit beside the
  // resident models.
  absl::Status CheckCall(double bytes) const;
  double resident_bytes() const;

 private:
  struct Held {
    std::string tenant;
    double bytes = 0;
  };
  double TenantBytes(const std::string& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `needs` says what is admitted ("the model (...) needs").
  absl::Status ModelShortfall(const std::string& tenant, double bytes,
                              const char* needs) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CallShortfall(double bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells on_refusal of a refusal of `what`; returns `status`.
  absl::Status Report(absl::Status status, const char* what) const;
  void ReportResident() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const MemoryAdmissionOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Held> models_ ABSL_GUARDED_BY(mu_);
  double total_ ABSL_GUARDED_BY(mu_) = 0;
};

// The bytes per rank a sampler snapshot of `model` holds
// (runtime/engine/sampler_snapshots.h), an upper bound like the model's: its
// parameters as kept (a LoRA model's adapter alone) split over `dp_shard`,
// plus the gathered copy that ZeRO stages 1 and 2 keep between steps.
double SamplerSnapshotBytes(const ModelSummary& model, int dp_shard,
                            ZeroStage zero);

// The default --max-memory-bytes of one rank: 80% of the machine's memory,
// or of the cgroup's limit when that is lower, shared by `local_ranks`.
int64_t DefaultMemoryLimitBytes(int local_ranks);

// A CUDA device's memory as the rank saw it at start.
struct DeviceMemorySnapshot {
  std::string device;     // "cuda:0"
  double free_bytes = 0;  // cudaMemGetInfo
  double total_bytes = 0;
  double reserved_bytes = 0;   // the caching allocator's, used or not
  double allocated_bytes = 0;  // the caching allocator's, in live tensors
};

struct MemoryLimit {
  double bytes = 0;
  std::string name;  // MemoryAdmissionOptions::limit_name
};

// What is kept free on a device for what admission does not count (cuBLAS
// workspaces, NCCL buffers, fragmentation): the larger of these.
inline constexpr double kDeviceMarginBytes = 1024.0 * 1024 * 1024;
inline constexpr double kDeviceMarginFraction = 0.05;  // of the total

// A CUDA rank's limit: free + (reserved - allocated) - margin, at least 0;
// `flag_bytes` (--max-memory-bytes, 0: unset) instead when it is lower. The
// name carries the numbers, so that a refusal names the device and them.
MemoryLimit DeviceMemoryLimit(const DeviceMemorySnapshot& memory,
                              int64_t flag_bytes);

}  // namespace tally

#endif  // TALLY_SERVER_ADMISSION_H_
