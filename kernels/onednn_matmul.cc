#include "kernels/onednn_matmul.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tally {
namespace {

// One cached primitive per (M, K, N, a's strides, b's strides). The number
// of rows M follows the batch, so the cache is bounded: when full it starts
// over (oneDNN's own primitive cache still makes a rebuild cheap).
using ShapeKey = std::array<int64_t, 7>;
constexpr size_t kMaxCachedPrimitives = 128;

dnnl::engine& CpuEngine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

// Whether oneDNN can read `t` [rows, cols] in place: one dimension has unit
// stride and the other a leading dimension that covers it.
bool PlainLayout(const torch::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  return (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(cols, 1)) ||
         (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(rows, 1));
}

absl::Status CheckOperand(const torch::Tensor& t, const char* name) {
  if (!t.defined() || t.dim() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("MatmulBf16ToFloat32: ", name, " must be a 2-D tensor"));
  }
  if (t.scalar_type() != torch::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("MatmulBf16ToFloat32: ", name, " must be bfloat16, got ",
                     std::string(c10::toString(t.scalar_type()))));
  }
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat("MatmulBf16ToFloat32: ", name,
                     " must be a CPU tensor, got ", t.device().str()));
  }
  return absl::OkStatus();
}

dnnl::memory::desc Describe(const torch::Tensor& t,
                            dnnl::memory::data_type type) {
  return dnnl::memory::desc({t.size(0), t.size(1)}, type,
                            {t.stride(0), t.stride(1)});
}

dnnl::matmul& CachedPrimitive(const torch::Tensor& a, const torch::Tensor& b,
                              const torch::Tensor& c) {
  thread_local std::map<ShapeKey, dnnl::matmul> cache;
  const ShapeKey key = {a.size(0),   a.size(1),   b.size(1),  a.stride(0),
                        a.stride(1), b.stride(0), b.stride(1)};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= kMaxCachedPrimitives) cache.clear();
  using dt = dnnl::memory::data_type;
  const dnnl::matmul::desc desc(Describe(a, dt::bf16), Describe(b, dt::bf16),
                                Describe(c, dt::f32));
  const dnnl::matmul::primitive_desc pd(desc, CpuEngine());
  return cache.emplace(key, dnnl::matmul(pd)).first->second;
}

}  // namespace

bool HasBf16ToFloat32Matmul() { return true; }

absl::StatusOr<torch::Tensor> MatmulBf16ToFloat32(const torch::Tensor& a,
                                                  const torch::Tensor& b) {
  if (absl::Status s = CheckOperand(a, "a"); !s.ok()) return s;
  if (absl::Status s = CheckOperand(b, "b"); !s.ok()) return s;
  if (a.size(1) != b.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MatmulBf16ToFloat32: a is [", a.size(0), ", ", a.size(1),
        "] but b is [", b.size(0), ", ", b.size(1), "]: inner sizes differ"));
  }
  const torch::TensorOptions f32 = a.options().dtype(torch::kFloat32);
  // oneDNN refuses empty dimensions; an empty sum is zero.
  if (a.numel() == 0 || b.numel() == 0) {
    return torch::zeros({a.size(0), b.size(1)}, f32);
  }
  const torch::Tensor lhs = PlainLayout(a) ? a : a.contiguous();
  const torch::Tensor rhs = PlainLayout(b) ? b : b.contiguous();
  torch::Tensor out = torch::empty({a.size(0), b.size(1)}, f32);
  try {
    dnnl::matmul& matmul = CachedPrimitive(lhs, rhs, out);
    using dt = dnnl::memory::data_type;
    dnnl::engine& engine = CpuEngine();
    dnnl::memory a_mem(Describe(lhs, dt::bf16), engine, lhs.data_ptr());
    dnnl::memory b_mem(Describe(rhs, dt::bf16), engine, rhs.data_ptr());
    dnnl::memory c_mem(Describe(out, dt::f32), engine, out.data_ptr());
    dnnl::stream stream(engine);
    matmul.execute(stream, {{DNNL_ARG_SRC, a_mem},
                            {DNNL_ARG_WEIGHTS, b_mem},
                            {DNNL_ARG_DST, c_mem}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("MatmulBf16ToFloat32: oneDNN: ", e.what()));
  }
  return out;
}

}  // namespace tally
