#include "runtime/model/freeze_parameters.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "runtime/parallel/sharding_plan.h"

namespace tally {

absl::Status FreezeParameters(const std::vector<std::string>& patterns,
                              CausalLm& model) {
  const std::vector<std::string> names = model.ParameterNames();
  for (const std::string& pattern : patterns) {
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) {
          return NameMatches(pattern, n);
        })) {
      return absl::InvalidArgumentError(absl::StrCat(
          "frozen: '", pattern, "' matches no parameter of the model"));
    }
    model.Freeze(pattern);
  }
  return absl::OkStatus();
}

}  // namespace tally
