// LossSpec: the per-token loss a ForwardBackward names and its settings, as
// plain data (torch-free), so the front end refuses a bad loss before a call
// is queued; loss_registry.h builds the TokenLoss it describes.
//
// Each loss's settings are Tinker's loss_fn_config keys with their defaults:
//   cross_entropy, importance_sampling  none
//   ppo, cispo   clip_low_threshold (0.8), clip_high_threshold (1.2)
//   dro          beta (required)
//
//   TALLY_ASSIGN_OR_RETURN(tally::LossSpec spec,
//                          tally::ParseLossSpec("ppo", request_config));
//   spec.settings.at("clip_low_threshold");  // 0.8 unless the request set it
#ifndef TALLY_RUNTIME_CONFIG_LOSS_SPEC_H_
#define TALLY_RUNTIME_CONFIG_LOSS_SPEC_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

// The per-token inputs of the RL losses (Sample::token_inputs keys, named as
// the v1::Sample fields that carry them).
inline constexpr char kAdvantages[] = "advantages";
inline constexpr char kSamplingLogprobs[] = "sampling_logprobs";

// The range of a sampling_logprobs value (ValidateSamples): a log-probability
// is <= 0, and a token a sampler drew has one far above this bound (float32
// probabilities end near e^-104, float64 ones near e^-745). A value past it
// would only scale the policy losses' gradients (DRO's grows with the
// log-ratio) into overflow.
inline constexpr double kMinSamplingLogprob = -1e4;

struct LossSpec {
  std::string name = "cross_entropy";
  // Every setting the loss reads, defaults filled in.
  std::map<std::string, double> settings;
};

// The loss `name` with `config` over its defaults: INVALID_ARGUMENT naming
// the field for an unknown loss, a key the loss does not read, a missing
// required setting or a value out of range.
absl::StatusOr<LossSpec> ParseLossSpec(
    absl::string_view name, const std::map<std::string, double>& config);

// Every loss name, in the order of v1::LossFn.
std::vector<std::string> LossNames();

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_LOSS_SPEC_H_
