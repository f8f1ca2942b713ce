// Checkpoint retention: where the server's periodic checkpoints of a model go
// and how many of them are kept. A model's step checkpoints live in
// `<model_dir>/step-<12 digits>`, so a directory listing sorts them by step.
//
//   const std::string dir = tally::StepCheckpointDir(model_dir, step);
//   ... write the checkpoint to dir ...
//   TALLY_RETURN_IF_ERROR(tally::PruneStepCheckpoints(model_dir, /*keep=*/3));
//   std::vector<std::string> newest_first =
//   tally::ListStepCheckpoints(model_dir);
#ifndef TALLY_SERVER_CHECKPOINT_RETENTION_H_
#define TALLY_SERVER_CHECKPOINT_RETENTION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tally {

std::string StepCheckpointDir(const std::string& model_dir, int64_t step);
// The step checkpoints in `model_dir`, newest (highest step) first; hidden
// staging directories are not listed. Empty when `model_dir` is missing.
std::vector<std::string> ListStepCheckpoints(const std::string& model_dir);
// Deletes all but the newest `keep` step checkpoints of `model_dir`, and any
// staging directory a crashed save left there.
absl::Status PruneStepCheckpoints(const std::string& model_dir, int keep);

}  // namespace tally

#endif  // TALLY_SERVER_CHECKPOINT_RETENTION_H_
