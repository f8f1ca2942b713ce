// Accumulation window: what a model has gathered since its last OptimStep,
// and the in-place normalize-and-clip that OptimStep starts with.
//
// The window holds one loss reduction, the number of calls, valid tokens and
// counted samples; gradients themselves accumulate in each parameter's
// `.grad` (LibTorch adds every backward into it), so ForwardBackward never
// zeroes anything and chunked client batches add up exactly.
//
//   tally::AccumulationWindow window;
//   TALLY_RETURN_IF_ERROR(window.CheckReduction(LossReduction::kTokenMean));
//   window.Add(LossReduction::kTokenMean, /*tokens=*/37, /*samples=*/2);
//   TALLY_ASSIGN_OR_RETURN(tally::ClipResult clip, tally::NormalizeAndClip(
//       params, window.Normalizer(), mesh, world, NormType::kL2, 1.0));
#ifndef TALLY_RUNTIME_ACCUMULATION_H_
#define TALLY_RUNTIME_ACCUMULATION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/communicator.h"
#include "runtime/grad_norm.h"
#include "runtime/llama_model.h"
#include "runtime/mesh.h"
#include "runtime/types.h"

namespace tally {

class AccumulationWindow {
 public:
  // FAILED_PRECONDITION when a window of another reduction is pending.
  absl::Status CheckReduction(LossReduction reduction) const;
  void Add(LossReduction reduction, int64_t tokens, int64_t samples);
  // Tokens (TOKEN_MEAN), samples (SAMPLE_MEAN) or 1 (SUM); 0 when nothing
  // valid was accumulated, whatever the reduction.
  double Normalizer() const;
  const WindowCounts& counts() const { return counts_; }
  bool empty() const { return counts_.calls == 0; }
  void Clear() { counts_ = WindowCounts(); }

 private:
  WindowCounts counts_;
};

// Gradients of the window, normalized and clipped, ready for the optimizer.
struct ClipResult {
  GradNorm norm;           // of the normalized gradient, before clipping
  double clip_coef = 1.0;  // min(1, max_norm / (norm + 1e-6)), 1 if no clip
};

// Measures the global norm of the normalized gradient (raw / normalizer) and,
// when it is finite, scales every gradient in place by clip_coef / normalizer
// in one pass. With a non-finite norm the gradients are left untouched, so
// the caller can still skip or refuse with nothing changed.
absl::StatusOr<ClipResult> NormalizeAndClip(std::vector<Parameter>& parameters,
                                            double normalizer, const Mesh& mesh,
                                            Communicator& world,
                                            NormType norm_type,
                                            double max_grad_norm);

// Zeroes every gradient (the end of a window).
void ZeroGradients(std::vector<Parameter>& parameters);

}  // namespace tally

#endif  // TALLY_RUNTIME_ACCUMULATION_H_
