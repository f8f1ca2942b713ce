#include "runtime/train/step_guard.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace tally {

std::optional<std::string> UnsafeStepReason(const ClipResult& clip,
                                            const AdamParams& hp,
                                            OptimizerKind optimizer,
                                            DType dtype) {
  const double norm = clip.norm.total;
  if (!std::isfinite(norm)) {
    return absl::StrCat("non-finite gradient norm (", norm, ")");
  }
  // Half the largest finite value: a moment's update (beta * old +
  // (1 - beta) * new) of two values below it stays finite.
  const double limit = 0.5 * (MasterDType(dtype) == DType::kFloat64
                                  ? std::numeric_limits<double>::max()
                                  : std::numeric_limits<float>::max());
  const char* width =
      MasterDType(dtype) == DType::kFloat64 ? "float64" : "float32";
  // The largest gradient element the update reads.
  const double largest = norm * clip.clip_coef;
  if (optimizer == OptimizerKind::kAdamW && largest > std::sqrt(limit)) {
    return absl::StrCat(
        "gradient norm ", norm, " (", largest,
        " after clipping) is too large for AdamW: a gradient element that "
        "large squared overflows its second moment in ",
        width, " (largest allowed ", std::sqrt(limit),
        "); clip with max_grad_norm or scale the loss down");
  }
  if (optimizer == OptimizerKind::kSgd &&
      !(hp.learning_rate * largest <= limit)) {
    return absl::StrCat("gradient norm ", norm, " (", largest,
                        " after clipping) times ", "learning_rate ",
                        hp.learning_rate, " overflows the SGD update in ",
                        width, " (largest allowed ", limit,
                        "); clip with max_grad_norm or scale the loss down");
  }
  return std::nullopt;
}

}  // namespace tally
