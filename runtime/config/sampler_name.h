// Sampler snapshots (runtime/engine/sampler_snapshots.h) as the server's
// request checks and listings see them, torch-free: what a snapshot's name
// may be, and what lists one.
//
//   TALLY_RETURN_IF_ERROR(tally::ValidateSamplerName(request.name()));
//   TALLY_RETURN_IF_ERROR(tally::ValidateSamplerName(sampler, "sampler"));
#ifndef TALLY_RUNTIME_CONFIG_SAMPLER_NAME_H_
#define TALLY_RUNTIME_CONFIG_SAMPLER_NAME_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace tally {

// What a snapshot is, as listed.
struct SamplerSummary {
  std::string model_id;
  std::string name;
  int64_t step = 0;    // the model's step whose weights it froze
  uint64_t bytes = 0;  // what this rank's copy holds
  absl::Time created;
  bool is_adapter = false;  // a LoRA model's: the adapter alone
};

// INVALID_ARGUMENT naming `field` unless `name` is 1 to 128 letters,
// digits, '.', '_' or '-', not "." or ".." (it appears in paths:
// tally://<model>/samplers/<name>).
absl::Status ValidateSamplerName(const std::string& name,
                                 const std::string& field = "name");

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_SAMPLER_NAME_H_
