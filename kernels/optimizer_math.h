// The per-element arithmetic of tally's fused optimizer updates, shared by
// the CPU kernels (kernels/fused_optimizer.cc) and the CUDA ones
// (kernels/cuda/fused_optimizer.cu) so both round exactly alike. Plain C++
// (no LibTorch), usable from nvcc as host and device code.
//
// Each step rounds where the composed LibTorch path rounds: grad.mul_(scale),
// then torch::optim::AdamW (LibTorch 1.13, decoupled weight decay) or
// p.mul_(1 - lr * wd).add_(grad, -lr) for SGD, with the fused multiply-adds
// of ATen's AVX2 kernels in add_(t, alpha) and addcmul_. Translation units
// that include this must not let the compiler contract a * b + c on its own
// (-ffp-contract=off; nvcc -fmad=false).
//
//   const auto c = tally::kernels::MakeAdamWConstants<float>(hp);
//   for (int64_t i = 0; i < n; ++i) {
//     tally::kernels::AdamWElement(p[i], g[i], m[i], v[i], c);
//   }
#ifndef TALLY_KERNELS_OPTIMIZER_MATH_H_
#define TALLY_KERNELS_OPTIMIZER_MATH_H_

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define TALLY_HOST_DEVICE __host__ __device__
#else
#define TALLY_HOST_DEVICE
#endif

namespace tally::kernels {

struct UpdateHyperparameters {
  double learning_rate = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;         // 1 for the first update (bias correction)
  double grad_scale = 1.0;  // every gradient is read as grad * grad_scale
};

// The step's scalars, computed in double and rounded once to T, as ATen
// rounds a double Scalar argument to the tensor's dtype.
template <typename T>
struct AdamWConstants {
  T grad_scale;
  T decay;  // 1 - lr * wd: exactly 1 when wd == 0, so p * decay == p
  T beta1;
  T one_minus_beta1;
  T beta2;
  T one_minus_beta2;
  T sqrt_bias_correction2;
  T eps;
  T step_size;  // -lr / bias_correction1
};

template <typename T>
AdamWConstants<T> MakeAdamWConstants(const UpdateHyperparameters& hp) {
  const double bias_correction1 =
      1 - pow(hp.beta1, static_cast<double>(hp.step));
  const double bias_correction2 =
      1 - pow(hp.beta2, static_cast<double>(hp.step));
  return {static_cast<T>(hp.grad_scale),
          static_cast<T>(1 - hp.learning_rate * hp.weight_decay),
          static_cast<T>(hp.beta1),
          static_cast<T>(1 - hp.beta1),
          static_cast<T>(hp.beta2),
          static_cast<T>(1 - hp.beta2),
          static_cast<T>(sqrt(bias_correction2)),
          static_cast<T>(hp.eps),
          static_cast<T>(-hp.learning_rate / bias_correction1)};
}

template <typename T>
struct SgdConstants {
  T grad_scale;
  T decay;
  T negative_lr;
};

template <typename T>
SgdConstants<T> MakeSgdConstants(const UpdateHyperparameters& hp) {
  return {static_cast<T>(hp.grad_scale),
          static_cast<T>(1 - hp.learning_rate * hp.weight_decay),
          static_cast<T>(-hp.learning_rate)};
}

// Single-rounding a * b + c and sqrt in the argument's own precision (the
// float overloads of fma / sqrt are not in the global namespace on the host).
TALLY_HOST_DEVICE inline float FusedMultiplyAdd(float a, float b, float c) {
  return fmaf(a, b, c);
}
TALLY_HOST_DEVICE inline double FusedMultiplyAdd(double a, double b, double c) {
  return fma(a, b, c);
}
TALLY_HOST_DEVICE inline float SquareRoot(float x) { return sqrtf(x); }
TALLY_HOST_DEVICE inline double SquareRoot(double x) { return sqrt(x); }

// One AdamW update of one element; `grad` is the raw gradient.
template <typename T>
TALLY_HOST_DEVICE inline void AdamWElement(T& param, T grad, T& exp_avg,
                                           T& exp_avg_sq,
                                           const AdamWConstants<T>& c) {
  // grad.mul_(clip_coef / normalizer)
  const T g = grad * c.grad_scale;
  // p.mul_(1 - lr * wd)
  const T decayed = param * c.decay;
  // exp_avg.mul_(beta1).add_(g, 1 - beta1): add_ with alpha is an fma.
  const T m = FusedMultiplyAdd(g, c.one_minus_beta1, exp_avg * c.beta1);
  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2): self + value * g * g,
  // which ATen's build contracts into fma(value * g, g, self).
  const T v = FusedMultiplyAdd(c.one_minus_beta2 * g, g, exp_avg_sq * c.beta2);
  // (exp_avg_sq.sqrt() / sqrt(bias_correction2)).add_(eps)
  const T denom = SquareRoot(v) / c.sqrt_bias_correction2 + c.eps;
  // p.addcdiv_(exp_avg, denom, -lr / bias_correction1)
  param = decayed + (c.step_size * m) / denom;
  exp_avg = m;
  exp_avg_sq = v;
}

// One SGD update of one element: p.mul_(1 - lr * wd).add_(g * scale, -lr).
template <typename T>
TALLY_HOST_DEVICE inline void SgdElement(T& param, T grad,
                                         const SgdConstants<T>& c) {
  param = FusedMultiplyAdd(grad * c.grad_scale, c.negative_lr, param * c.decay);
}

}  // namespace tally::kernels

#endif  // TALLY_KERNELS_OPTIMIZER_MATH_H_
