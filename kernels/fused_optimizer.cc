#include "kernels/fused_optimizer.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_clones.h"
#include "kernels/cuda_tensors.h"
#include "kernels/optimizer_math.h"

// Compiled with -ffp-contract=off, as optimizer_math.h requires, and
// -fno-math-errno so that sqrt vectorizes (kernels/CMakeLists.txt).

namespace tally::kernels {
namespace {

// Small enough to balance a few large tensors over the threads, large enough
// that the per-chunk dispatch is noise next to the memory traffic.
constexpr int64_t kChunkElements = 32 * 1024;

// Inlined into each clone below so that it is compiled for the clone's ISA.
template <typename T>
[[gnu::always_inline]] inline void AdamWLoop(
    T* __restrict param, const T* __restrict grad, T* __restrict exp_avg,
    T* __restrict exp_avg_sq, int64_t count, const AdamWConstants<T>& c) {
  for (int64_t i = 0; i < count; ++i) {
    AdamWElement(param[i], grad[i], exp_avg[i], exp_avg_sq[i], c);
  }
}

TALLY_KERNEL_CLONES void AdamWChunk(float* param, const float* grad,
                                    float* exp_avg, float* exp_avg_sq,
                                    int64_t count,
                                    const AdamWConstants<float>& c) {
  AdamWLoop(param, grad, exp_avg, exp_avg_sq, count, c);
}

TALLY_KERNEL_CLONES void AdamWChunk(double* param, const double* grad,
                                    double* exp_avg, double* exp_avg_sq,
                                    int64_t count,
                                    const AdamWConstants<double>& c) {
  AdamWLoop(param, grad, exp_avg, exp_avg_sq, count, c);
}

template <typename T>
[[gnu::always_inline]] inline void SgdLoop(T* __restrict param,
                                           const T* __restrict grad,
                                           int64_t count,
                                           const SgdConstants<T>& c) {
  for (int64_t i = 0; i < count; ++i) SgdElement(param[i], grad[i], c);
}

TALLY_KERNEL_CLONES void SgdChunk(float* param, const float* grad,
                                  int64_t count, const SgdConstants<float>& c) {
  SgdLoop(param, grad, count, c);
}

TALLY_KERNEL_CLONES void SgdChunk(double* param, const double* grad,
                                  int64_t count,
                                  const SgdConstants<double>& c) {
  SgdLoop(param, grad, count, c);
}

absl::Status CheckOperand(const char* name, const torch::Tensor& operand,
                          const torch::Tensor& param) {
  if (!operand.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is undefined"));
  }
  if (operand.device() != param.device()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is on ", operand.device().str(),
                     "; expected the param's ", param.device().str()));
  }
  if (operand.scalar_type() != param.scalar_type()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " has dtype ", c10::toString(operand.scalar_type()),
        "; expected the param's ", c10::toString(param.scalar_type())));
  }
  if (operand.sizes() != param.sizes()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has shape ", c10::str(operand.sizes()),
                     "; expected the param's ", c10::str(param.sizes())));
  }
  if (!operand.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is not contiguous"));
  }
  return absl::OkStatus();
}

// CPU parameters, or CUDA ones where this build can update them.
absl::Status CheckDevice(const torch::Tensor& param) {
  if (param.device().is_cpu()) return absl::OkStatus();
  if (!param.device().is_cuda()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "param is on ", param.device().str(), "; expected cpu or cuda"));
  }
  const absl::Status support = CudaTensorSupport();
  if (support.ok()) return support;
  return absl::Status(
      support.code(),
      absl::StrCat("param is on ", param.device().str(),
                   ", which this build cannot update: ", support.message()));
}

// One call updates the tensors of one device: the CPU kernels or one CUDA
// device's stream, never both.
absl::Status CheckOneDevice(const std::vector<UpdateOperands>& tensors) {
  for (size_t i = 1; i < tensors.size(); ++i) {
    const torch::Tensor& first = tensors[0].param;
    const torch::Tensor& param = tensors[i].param;
    if (first.defined() && param.defined() &&
        param.device() != first.device()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensors[", i, "].param is on ", param.device().str(),
                       " but tensors[0].param on ", first.device().str(),
                       ": one call updates the tensors of one device"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAll(const std::vector<UpdateOperands>& tensors,
                      bool with_moments) {
  const absl::Status one_device = CheckOneDevice(tensors);
  if (!one_device.ok()) return one_device;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const absl::Status status = CheckFusable(tensors[i], with_moments);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("tensors[", i, "].", status.message()));
    }
  }
  return absl::OkStatus();
}

struct Chunk {
  int entry;
  int64_t begin;
  int64_t count;
};

// Calls fn(operands, begin, count) for every chunk of every entry, the
// chunks spread over the ATen intra-op threads.
template <typename Fn>
void ForEachChunk(const std::vector<UpdateOperands>& tensors, const Fn& fn) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t numel = tensors[i].param.numel();
    for (int64_t begin = 0; begin < numel; begin += kChunkElements) {
      chunks.push_back({static_cast<int>(i), begin,
                        std::min(kChunkElements, numel - begin)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), /*grain_size=*/1,
                   [&](int64_t first, int64_t last) {
                     for (int64_t c = first; c < last; ++c) {
                       const Chunk& chunk = chunks[c];
                       fn(tensors[chunk.entry], chunk.begin, chunk.count);
                     }
                   });
}

template <typename T>
T* At(const torch::Tensor& tensor, int64_t offset) {
  return tensor.data_ptr<T>() + offset;
}

}  // namespace

absl::Status CheckFusable(const UpdateOperands& tensors, bool with_moments) {
  const torch::Tensor& param = tensors.param;
  if (!param.defined()) return absl::InvalidArgumentError("param is undefined");
  if (param.scalar_type() != torch::kFloat &&
      param.scalar_type() != torch::kDouble) {
    return absl::InvalidArgumentError(
        absl::StrCat("param has dtype ", c10::toString(param.scalar_type()),
                     "; expected Float or Double"));
  }
  absl::Status status = CheckDevice(param);
  if (status.ok()) status = CheckOperand("param", param, param);
  if (status.ok()) status = CheckOperand("grad", tensors.grad, param);
  if (!status.ok()) return status;
  if (!with_moments) {
    if (tensors.exp_avg.defined() || tensors.exp_avg_sq.defined()) {
      return absl::InvalidArgumentError(
          "exp_avg and exp_avg_sq must be undefined for SGD");
    }
    return absl::OkStatus();
  }
  status = CheckOperand("exp_avg", tensors.exp_avg, param);
  if (status.ok()) {
    status = CheckOperand("exp_avg_sq", tensors.exp_avg_sq, param);
  }
  if (!status.ok()) return status;
  // The loops promise the compiler that no two operands overlap.
  const torch::Tensor* operands[] = {&param, &tensors.grad, &tensors.exp_avg,
                                     &tensors.exp_avg_sq};
  for (int a = 0; a < 4; ++a) {
    for (int b = a + 1; b < 4; ++b) {
      if (!with_moments && b >= 2) continue;
      if (param.numel() > 0 && operands[a]->is_alias_of(*operands[b])) {
        return absl::InvalidArgumentError(
            "param, grad, exp_avg and exp_avg_sq must not share storage");
      }
    }
  }
  return absl::OkStatus();
}

absl::Status FusedAdamW(const std::vector<UpdateOperands>& tensors,
                        const UpdateHyperparameters& hp) {
  const absl::Status checked = CheckAll(tensors, /*with_moments=*/true);
  if (!checked.ok()) return checked;
  if (!tensors.empty() && tensors[0].param.is_cuda()) {
    return FusedAdamWCudaTensors(tensors, hp);
  }
  const AdamWConstants<float> float_constants = MakeAdamWConstants<float>(hp);
  const AdamWConstants<double> double_constants =
      MakeAdamWConstants<double>(hp);
  ForEachChunk(
      tensors, [&](const UpdateOperands& t, int64_t begin, int64_t count) {
        if (t.param.scalar_type() == torch::kFloat) {
          AdamWChunk(At<float>(t.param, begin), At<float>(t.grad, begin),
                     At<float>(t.exp_avg, begin),
                     At<float>(t.exp_avg_sq, begin), count, float_constants);
        } else {
          AdamWChunk(At<double>(t.param, begin), At<double>(t.grad, begin),
                     At<double>(t.exp_avg, begin),
                     At<double>(t.exp_avg_sq, begin), count, double_constants);
        }
      });
  return absl::OkStatus();
}

absl::Status FusedSgd(const std::vector<UpdateOperands>& tensors,
                      const UpdateHyperparameters& hp) {
  const absl::Status checked = CheckAll(tensors, /*with_moments=*/false);
  if (!checked.ok()) return checked;
  if (!tensors.empty() && tensors[0].param.is_cuda()) {
    return FusedSgdCudaTensors(tensors, hp);
  }
  const SgdConstants<float> float_constants = MakeSgdConstants<float>(hp);
  const SgdConstants<double> double_constants = MakeSgdConstants<double>(hp);
  ForEachChunk(tensors,
               [&](const UpdateOperands& t, int64_t begin, int64_t count) {
                 if (t.param.scalar_type() == torch::kFloat) {
                   SgdChunk(At<float>(t.param, begin), At<float>(t.grad, begin),
                            count, float_constants);
                 } else {
                   SgdChunk(At<double>(t.param, begin),
                            At<double>(t.grad, begin), count, double_constants);
                 }
               });
  return absl::OkStatus();
}

}  // namespace tally::kernels
