// The build without oneDNN's matmul: its LibTorch is not Debian's (see
// kernels/CMakeLists.txt), so Debian's libdnnl is not linked beside the
// oneDNN that LibTorch carries.
#include "absl/status/status.h"
#include "kernels/onednn_matmul.h"

namespace tally {

bool HasBf16ToFloat32Matmul() { return false; }

absl::StatusOr<torch::Tensor> MatmulBf16ToFloat32(const torch::Tensor&,
                                                  const torch::Tensor&) {
  return absl::UnimplementedError(
      "MatmulBf16ToFloat32: this build has no oneDNN matmul (its LibTorch is "
      "not Debian's LibTorch 1.x linking the system libdnnl)");
}

}  // namespace tally
