#include "runtime/grad_buckets.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace tally {
namespace {

// Where a piece of one gradient sits in the bucket being packed.
struct Span {
  size_t grad;
  int64_t first;  // the piece's first element in the gradient
  int64_t count;
  int64_t position;  // its first element in the bucket
};

// Sums `grads` (contiguous, one dtype) over `group`, bucket by bucket.
absl::Status AllReduceOneDtype(const std::vector<torch::Tensor>& grads,
                               Communicator& group, int64_t bucket_bytes) {
  int64_t total = 0;
  for (const torch::Tensor& grad : grads) total += grad.numel();
  if (total == 0) return absl::OkStatus();
  const int64_t bucket_elements =
      std::max<int64_t>(1, bucket_bytes / grads.front().element_size());
  torch::Tensor buffer =
      torch::empty({std::min(total, bucket_elements)}, grads.front().options());
  // The next gradient to pack, and how many of its elements are packed.
  size_t next = 0;
  int64_t offset = 0;
  for (int64_t start = 0; start < total; start += bucket_elements) {
    const int64_t length = std::min(bucket_elements, total - start);
    torch::Tensor bucket = buffer.narrow(0, 0, length);
    std::vector<Span> spans;
    for (int64_t filled = 0; filled < length;) {
      const int64_t count =
          std::min(grads[next].numel() - offset, length - filled);
      if (count > 0) spans.push_back({next, offset, count, filled});
      filled += count;
      offset += count;
      if (offset == grads[next].numel()) {
        ++next;
        offset = 0;
      }
    }
    TALLY_RETURN_IF_ERROR(CatchTorch("pack gradient bucket", [&] {
      for (const Span& s : spans) {
        bucket.narrow(0, s.position, s.count)
            .copy_(grads[s.grad].view({-1}).narrow(0, s.first, s.count));
      }
    }));
    TALLY_RETURN_IF_ERROR(group.AllReduce(bucket, ReduceOp::kSum));
    TALLY_RETURN_IF_ERROR(CatchTorch("unpack gradient bucket", [&] {
      for (const Span& s : spans) {
        grads[s.grad]
            .view({-1})
            .narrow(0, s.first, s.count)
            .copy_(bucket.narrow(0, s.position, s.count));
      }
    }));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AllReduceGradientsInBuckets(std::vector<Parameter>& parameters,
                                         Communicator& group,
                                         int64_t bucket_bytes) {
  if (bucket_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket_bytes must be >= 1, got ", bucket_bytes));
  }
  // Per dtype, in the order of each dtype's first gradient, so every rank
  // issues the same collectives in the same order.
  std::vector<torch::ScalarType> order;
  std::map<torch::ScalarType, std::vector<torch::Tensor>> by_dtype;
  TALLY_RETURN_IF_ERROR(CatchTorch("collect gradients", [&] {
    torch::NoGradGuard no_grad;
    for (Parameter& p : parameters) {
      torch::Tensor& grad = p.tensor.mutable_grad();
      if (!grad.defined()) continue;
      // Packing goes through flat views of the gradient's own memory.
      if (!grad.is_contiguous()) grad = grad.contiguous();
      auto [it, inserted] = by_dtype.try_emplace(grad.scalar_type());
      if (inserted) order.push_back(grad.scalar_type());
      it->second.push_back(grad);
    }
  }));
  for (torch::ScalarType dtype : order) {
    TALLY_RETURN_IF_ERROR(
        AllReduceOneDtype(by_dtype[dtype], group, bucket_bytes));
  }
  return absl::OkStatus();
}

}  // namespace tally
