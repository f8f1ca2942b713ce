#include "runtime/model/rope.h"

#include <cmath>

namespace tally {

torch::Tensor RopeInverseFrequencies(const LlamaConfig& config) {
  const int64_t d = config.HeadDim();
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  torch::Tensor inv_freq =
      1.0 / torch::pow(config.rope_theta,
                       torch::arange(0, d, 2, f64) / static_cast<double>(d));
  const RopeScaling& scaling = config.rope_scaling;
  if (scaling.rope_type == "linear") return inv_freq / scaling.factor;
  if (scaling.rope_type != "llama3") return inv_freq;
  // transformers' _compute_llama3_parameters: wavelengths longer than
  // original / low_freq_factor are divided by factor, shorter than
  // original / high_freq_factor kept, and those between interpolated.
  const double original =
      static_cast<double>(scaling.original_max_position_embeddings);
  const double low_wavelen = original / scaling.low_freq_factor;
  const double high_wavelen = original / scaling.high_freq_factor;
  torch::Tensor wavelen = 2 * M_PI / inv_freq;
  torch::Tensor scaled =
      torch::where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq);
  torch::Tensor smooth = (original / wavelen - scaling.low_freq_factor) /
                         (scaling.high_freq_factor - scaling.low_freq_factor);
  torch::Tensor smoothed =
      (1 - smooth) * scaled / scaling.factor + smooth * scaled;
  torch::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
  return torch::where(medium, smoothed, scaled);
}

std::pair<torch::Tensor, torch::Tensor> RotaryTables(
    const LlamaConfig& config, const torch::Tensor& positions,
    torch::ScalarType dtype) {
  // Drawn on the host in fp64, the same on every device.
  torch::Tensor freqs =
      positions.to(torch::kFloat64).unsqueeze(-1) *
      RopeInverseFrequencies(config).to(positions.device());  // [B, T, d/2]
  torch::Tensor emb = torch::cat({freqs, freqs}, -1).unsqueeze(1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

torch::Tensor RotateHalf(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace tally
