// Checkpoint retention: where the server's periodic checkpoints of a model go
// and how many of them are kept. A model's step checkpoints live in
// `<model_dir>/step-<12 digits>`, so a directory listing sorts them by step.
//
//   const std::string dir = tally::StepCheckpointDir(model_dir, step);
//   ... write the checkpoint to dir ...
//   TALLY_RETURN_IF_ERROR(tally::PruneStepCheckpoints(model_dir, /*keep=*/3));
//   std::vector<std::string> newest_first =
//   tally::ListStepCheckpoints(model_dir);
//
// PeriodicSweep runs a retention pass (the artifacts whose ttl_seconds
// expired, ArtifactStore::SweepExpired) on a timer thread:
//
//   tally::PeriodicSweep sweep(absl::Minutes(1), [&] { ... });
//   // ... destroying it stops the thread; a pass under way finishes first.
#ifndef TALLY_SERVER_CHECKPOINT_RETENTION_H_
#define TALLY_SERVER_CHECKPOINT_RETENTION_H_

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tally {

std::string StepCheckpointDir(const std::string& model_dir, int64_t step);
// The step checkpoints in `model_dir`, newest (highest step) first; hidden
// staging directories are not listed. Empty when `model_dir` is missing.
std::vector<std::string> ListStepCheckpoints(const std::string& model_dir);
// Deletes all but the newest `keep` step checkpoints of `model_dir`, and any
// staging directory a crashed save left there.
absl::Status PruneStepCheckpoints(const std::string& model_dir, int keep);

// Calls `pass` every `interval` (the first time one interval after
// construction) on a thread of its own, until destroyed.
class PeriodicSweep {
 public:
  PeriodicSweep(absl::Duration interval, std::function<void()> pass);
  ~PeriodicSweep();
  PeriodicSweep(const PeriodicSweep&) = delete;
  PeriodicSweep& operator=(const PeriodicSweep&) = delete;

 private:
  void Loop();

  const absl::Duration interval_;
  const std::function<void()> pass_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tally

#endif  // TALLY_SERVER_CHECKPOINT_RETENTION_H_
