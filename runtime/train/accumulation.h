// Accumulation window: what a model has gathered since its last OptimStep,
// and the normalize-and-clip decision that OptimStep starts with.
//
// The window holds one loss reduction, the number of calls, valid tokens and
// counted samples; gradients themselves accumulate in each parameter's
// `.grad` (LibTorch adds every backward into it), so ForwardBackward never
// zeroes anything and chunked client batches add up exactly.
//
//   tally::AccumulationWindow window;
//   TALLY_RETURN_IF_ERROR(window.CheckReduction(LossReduction::kTokenMean));
//   window.Add(LossReduction::kTokenMean, /*tokens=*/37, /*samples=*/2);
//   TALLY_ASSIGN_OR_RETURN(tally::ClipResult clip, tally::ComputeClip(
//       params, window.Normalizer(), mesh, world, NormType::kL2, 1.0));
//   TALLY_RETURN_IF_ERROR(optimizer.Step(hp, clip.grad_scale));
#ifndef TALLY_RUNTIME_TRAIN_ACCUMULATION_H_
#define TALLY_RUNTIME_TRAIN_ACCUMULATION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/config/types.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/grad_norm.h"
#include "runtime/parallel/mesh.h"
#include "runtime/parallel/parameter.h"

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

// How the window's raw gradients become the normalized, clipped gradient.
struct ClipResult {
  GradNorm norm;           // of the normalized gradient, before clipping
  double clip_coef = 1.0;  // min(1, max_norm / (norm + 1e-6)), 1 if no clip
  // clip_coef / normalizer: the factor applied to each raw gradient (0 when
  // the norm is not finite, which nothing must apply).
  double grad_scale = 0.0;
};

// Measures the global norm of the normalized gradient (raw / normalizer) in
// one stats pass and one all-reduce on `world`, and decides the clip
// coefficient. Gradients are not modified: OptimStep hands grad_scale to
// Optimizer::Step, which applies it while it reads each gradient.
absl::StatusOr<ClipResult> ComputeClip(const std::vector<Parameter>& parameters,
                                       double normalizer, const Mesh& mesh,
                                       Communicator& world, NormType norm_type,
                                       double max_grad_norm);

// ComputeClip, then, when the norm is finite, every gradient scaled in place
// by grad_scale: the composed path the fused OptimStep is tested against.
// With a non-finite norm the gradients are left untouched.
absl::StatusOr<ClipResult> NormalizeAndClip(std::vector<Parameter>& parameters,
                                            double normalizer, const Mesh& mesh,
                                            Communicator& world,
                                            NormType norm_type,
                                            double max_grad_norm);

// Zeroes every gradient (the end of a window).
void ZeroGradients(std::vector<Parameter>& parameters);

}  // namespace tally

#endif  // TALLY_RUNTIME_TRAIN_ACCUMULATION_H_
