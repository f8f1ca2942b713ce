// torch_compat: the one place that knows which LibTorch tally is built
// against. tally builds against Debian's LibTorch 1.13 (CPU only) and against
// the LibTorch of a torch 2.x wheel (2.11, with CUDA); code that differs
// between them goes through the names here instead of testing versions
// itself.
//
// TALLY_TORCH_CUDA is 1 when the LibTorch has CUDA (CUDA tensors can exist),
// else 0. The LibTorch headers carry no macro that says so, so the top-level
// CMakeLists.txt defines it for every target from what find_package(Torch)
// found; code for CUDA tensors is compiled only under `#if TALLY_TORCH_CUDA`.
//
//   #include "runtime/parallel/torch_compat.h"
//
//   c10::intrusive_ptr<tally::compat::C10dBackend> gloo =
//       c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
//   TALLY_ASSIGN_OR_RETURN(auto world, tally::MakeProcessGroupCommunicator(
//                                          std::move(gloo)));
//   #if TALLY_TORCH_CUDA
//   ...  // CUDA tensors, c10::cuda streams
//   #endif
#ifndef TALLY_RUNTIME_PARALLEL_TORCH_COMPAT_H_
#define TALLY_RUNTIME_PARALLEL_TORCH_COMPAT_H_

#include <ATen/core/Tensor.h>
#include <torch/version.h>

#include <string>

#ifndef TALLY_TORCH_CUDA
// The top-level CMakeLists.txt defines it for every target.
#error "TALLY_TORCH_CUDA is not defined (see runtime/parallel/torch_compat.h)"
#endif

#define TALLY_TORCH_VERSION_MAJOR TORCH_VERSION_MAJOR
#define TALLY_TORCH_VERSION_MINOR TORCH_VERSION_MINOR
// Whether the LibTorch is at least `major`.`minor`, in #if.
#define TALLY_TORCH_VERSION_AT_LEAST(major, minor) \
  (TALLY_TORCH_VERSION_MAJOR > (major) ||          \
   (TALLY_TORCH_VERSION_MAJOR == (major) &&        \
    TALLY_TORCH_VERSION_MINOR >= (minor)))

#if TALLY_TORCH_VERSION_AT_LEAST(2, 0)
namespace c10d {
class Backend;
}  // namespace c10d
#else
namespace c10d {
class ProcessGroup;
}  // namespace c10d
#endif

namespace tally::compat {

// The c10d class that a backend's group (c10d::ProcessGroupGloo) derives
// from, and that tally drives directly: in 1.x every backend is a
// c10d::ProcessGroup; from 2.0 on it is a c10d::Backend, and ProcessGroup
// became the front end dispatching to one Backend per device type. Both have
// the calls tally makes (getRank, getSize, getBackendName, allreduce,
// allgather, broadcast, send, recv, barrier, _reduce_scatter_base) with the
// same signatures, and ProcessGroupGloo's constructor, Options and device
// factories are the same too (2.x adds defaulted arguments only).
#if TALLY_TORCH_VERSION_AT_LEAST(2, 0)
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

// The key of parameter `p` in torch::optim::Optimizer::state(): the address
// of its TensorImpl as a string in 1.x; from 2.x on the map is keyed by the
// address itself.
#if TALLY_TORCH_VERSION_AT_LEAST(2, 0)
inline void* OptimizerStateKey(const at::Tensor& p) {
  return p.unsafeGetTensorImpl();
}
#else
inline std::string OptimizerStateKey(const at::Tensor& p) {
  return c10::guts::to_string(p.unsafeGetTensorImpl());
}
#endif

}  // namespace tally::compat

#endif  // TALLY_RUNTIME_PARALLEL_TORCH_COMPAT_H_
