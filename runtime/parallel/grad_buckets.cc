#include "runtime/parallel/grad_buckets.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace tally {
namespace grad_buckets_internal {

// Where a piece of one gradient sits in a bucket.
struct Span {
  size_t param;   // index in the parameter list
  int64_t first;  // the piece's first element in the gradient
  int64_t count;
  int64_t position;  // its first element in the bucket
};

struct Bucket {
  torch::ScalarType dtype;
  int64_t length = 0;
  std::vector<Span> spans;
};

// A started all-reduce and the buffer it reduces in place.
struct InFlight {
  size_t set;
  Bucket bucket;
  torch::Tensor buffer;
  PendingCollective pending;
};

}  // namespace grad_buckets_internal

namespace {

using grad_buckets_internal::Bucket;
using grad_buckets_internal::Span;

// What one parameter's gradient brings to the layout.
struct Entry {
  torch::ScalarType dtype;
  int64_t numel = 0;
  bool takes_part = false;
};

// The gradient as it stands: an undefined one takes no part but still names
// its dtype, so the dtype order does not depend on which gradients exist.
Entry Present(const Parameter& p) {
  const torch::Tensor& grad = p.tensor.grad();
  if (!grad.defined()) return {p.tensor.scalar_type(), 0, false};
  return {grad.scalar_type(), grad.numel(), true};
}

absl::Status CheckBucketBytes(int64_t bucket_bytes) {
  if (bucket_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket_bytes must be >= 1, got ", bucket_bytes));
  }
  return absl::OkStatus();
}

// Per dtype (in the order each first appears from the last parameter on),
// the gradients laid end to end from the last parameter to the first and
// cut into buckets of `bucket_bytes`.
std::vector<Bucket> LayOut(const std::vector<Entry>& entries,
                           int64_t bucket_bytes) {
  std::vector<torch::ScalarType> dtypes;
  for (size_t i = entries.size(); i-- > 0;) {
    if (std::find(dtypes.begin(), dtypes.end(), entries[i].dtype) ==
        dtypes.end()) {
      dtypes.push_back(entries[i].dtype);
    }
  }
  std::vector<Bucket> buckets;
  for (torch::ScalarType dtype : dtypes) {
    const int64_t capacity = std::max<int64_t>(
        1, bucket_bytes / static_cast<int64_t>(c10::elementSize(dtype)));
    bool open = false;  // whether buckets.back() is this dtype's and has room
    for (size_t i = entries.size(); i-- > 0;) {
      const Entry& e = entries[i];
      if (!e.takes_part || e.dtype != dtype) continue;
      for (int64_t first = 0; first < e.numel;) {
        if (!open) buckets.push_back({dtype, 0, {}});
        Bucket& bucket = buckets.back();
        const int64_t count =
            std::min(e.numel - first, capacity - bucket.length);
        bucket.spans.push_back({i, first, count, bucket.length});
        bucket.length += count;
        first += count;
        open = bucket.length < capacity;
      }
    }
  }
  return buckets;
}

// Copies the bucket's pieces of the gradients into `buffer` (zeros for a
// gradient that does not exist).
void Pack(const Bucket& bucket, const std::vector<Parameter>& params,
          torch::Tensor& buffer) {
  torch::NoGradGuard no_grad;
  for (const Span& s : bucket.spans) {
    torch::Tensor piece = buffer.narrow(0, s.position, s.count);
    const torch::Tensor& grad = params[s.param].tensor.grad();
    if (grad.defined()) {
      piece.copy_(grad.reshape({-1}).narrow(0, s.first, s.count));
    } else {
      piece.zero_();
    }
  }
}

// Copies the summed bucket back; the gradients must be contiguous.
void Unpack(const Bucket& bucket, const torch::Tensor& buffer,
            std::vector<Parameter>& params) {
  torch::NoGradGuard no_grad;
  for (const Span& s : bucket.spans) {
    params[s.param]
        .tensor.mutable_grad()
        .view({-1})
        .narrow(0, s.first, s.count)
        .copy_(buffer.narrow(0, s.position, s.count));
  }
}

// Makes every defined gradient contiguous (unpacking writes through flat
// views of it) and returns the layout of what exists.
std::vector<Bucket> LayOutPresentGradients(std::vector<Parameter>& params,
                                           int64_t bucket_bytes) {
  torch::NoGradGuard no_grad;
  std::vector<Entry> entries;
  for (Parameter& p : params) {
    torch::Tensor& grad = p.tensor.mutable_grad();
    if (grad.defined() && !grad.is_contiguous()) grad = grad.contiguous();
    entries.push_back(Present(p));
  }
  return LayOut(entries, bucket_bytes);
}

}  // namespace

absl::Status AllReduceGradientsInBuckets(std::vector<Parameter>& parameters,
                                         Communicator& group,
                                         int64_t bucket_bytes) {
  TALLY_RETURN_IF_ERROR(CheckBucketBytes(bucket_bytes));
  std::vector<Bucket> buckets;
  TALLY_RETURN_IF_ERROR(CatchTorch("collect gradients", [&] {
    buckets = LayOutPresentGradients(parameters, bucket_bytes);
  }));
  // One buffer for all buckets: each dtype's first bucket is its largest.
  torch::Tensor buffer;
  for (const Bucket& b : buckets) {
    torch::Tensor flat;
    TALLY_RETURN_IF_ERROR(CatchTorch("pack gradient bucket", [&] {
      if (!buffer.defined() || buffer.scalar_type() != b.dtype ||
          buffer.numel() < b.length) {
        buffer = torch::empty(
            {b.length},
            parameters[b.spans[0].param].tensor.options().dtype(b.dtype));
      }
      flat = buffer.narrow(0, 0, b.length);
      Pack(b, parameters, flat);
    }));
    TALLY_RETURN_IF_ERROR(group.AllReduce(flat, ReduceOp::kSum));
    TALLY_RETURN_IF_ERROR(CatchTorch("unpack gradient bucket",
                                     [&] { Unpack(b, flat, parameters); }));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<OverlappedGradientSum>>
OverlappedGradientSum::Create(std::vector<GradientSet> sets,
                              int64_t bucket_bytes) {
  TALLY_RETURN_IF_ERROR(CheckBucketBytes(bucket_bytes));
  for (size_t s = 0; s < sets.size(); ++s) {
    if (sets[s].group == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient set ", s, " has no group"));
    }
  }
  std::unique_ptr<OverlappedGradientSum> sum(
      new OverlappedGradientSum(std::move(sets), bucket_bytes));
  const absl::Status prepared =
      CatchTorch("register gradient hooks", [&] { sum->Prepare(); });
  if (!prepared.ok()) {
    sum->finished_ = true;  // nothing may start: the layout is incomplete
    return prepared;
  }
  return sum;
}

OverlappedGradientSum::OverlappedGradientSum(std::vector<GradientSet> sets,
                                             int64_t bucket_bytes)
    : sets_(std::move(sets)), bucket_bytes_(bucket_bytes) {}

void OverlappedGradientSum::Prepare() {
  for (size_t s = 0; s < sets_.size(); ++s) {
    std::vector<Parameter>& params = sets_[s].parameters;
    std::vector<Entry> entries;
    for (size_t i = 0; i < params.size(); ++i) {
      // Null when the parameter does not require grad: it never gets one.
      std::shared_ptr<torch::autograd::Node> accumulator =
          torch::autograd::impl::grad_accumulator(params[i].tensor);
      entries.push_back({params[i].tensor.scalar_type(),
                         params[i].tensor.numel(), accumulator != nullptr});
      if (accumulator == nullptr) continue;
      const uintptr_t key = accumulator->add_post_hook(
          std::make_unique<torch::autograd::utils::LambdaPostHook>(
              [this, s, i](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list&) {
                OnGradientAccumulated(s, i);
                return outputs;
              }));
      hooks_.push_back({std::move(accumulator), key});
    }
    planned_.push_back(LayOut(entries, bucket_bytes_));
    buckets_of_.emplace_back(params.size());
    unready_.emplace_back();
    accumulated_.emplace_back(params.size(), false);
    for (size_t b = 0; b < planned_[s].size(); ++b) {
      for (const Span& span : planned_[s][b].spans) {
        buckets_of_[s][span.param].push_back(b);
      }
      unready_[s].push_back(static_cast<int>(planned_[s][b].spans.size()));
    }

    auto same_group = [&](const Sequence& q) {
      return q.group == sets_[s].group;
    };
    auto it = std::find_if(sequences_.begin(), sequences_.end(), same_group);
    if (it == sequences_.end()) {
      it = sequences_.insert(sequences_.end(), Sequence{sets_[s].group, {}, 0});
    }
    sequence_of_.push_back(static_cast<size_t>(it - sequences_.begin()));
    for (size_t b = 0; b < planned_[s].size(); ++b) {
      it->order.emplace_back(s, b);
    }
  }
}

OverlappedGradientSum::~OverlappedGradientSum() {
  if (!finished_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      armed_ = false;
    }
    StartRemaining(planned_);
    WaitForAll().IgnoreError();
  }
  for (Hook& hook : hooks_) hook.accumulator->del_post_hook(hook.key);
}

void OverlappedGradientSum::Arm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = true;
}

int64_t OverlappedGradientSum::started_by_hooks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return started_by_hooks_;
}

void OverlappedGradientSum::OnGradientAccumulated(size_t set, size_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) return;
  if (accumulated_[set][param]) {
    // A bucket holding it may already have been packed.
    if (hook_error_.ok()) {
      hook_error_ = absl::InternalError(
          absl::StrCat("the gradient of ", sets_[set].parameters[param].name,
                       " was accumulated twice in one backward pass"));
    }
    return;
  }
  accumulated_[set][param] = true;
  for (size_t b : buckets_of_[set][param]) --unready_[set][b];
  Sequence& sequence = sequences_[sequence_of_[set]];
  while (sequence.next < sequence.order.size()) {
    const auto [s, b] = sequence.order[sequence.next];
    if (unready_[s][b] > 0) break;
    Start(s, planned_[s][b]);
    ++started_by_hooks_;
    ++sequence.next;
  }
}

void OverlappedGradientSum::Start(size_t set, const Bucket& bucket) {
  GradientSet& target = sets_[set];
  torch::Tensor buffer;
  const absl::Status packed = CatchTorch("pack gradient bucket", [&] {
    buffer = torch::empty(
        {bucket.length},
        target.parameters[bucket.spans[0].param].tensor.options().dtype(
            bucket.dtype));
    Pack(bucket, target.parameters, buffer);
  });
  // Not starting it leaves the peers waiting: they fail at the collective
  // timeout, as with any rank that stops midway.
  if (!packed.ok()) {
    if (hook_error_.ok()) hook_error_ = packed;
    return;
  }
  PendingCollective pending =
      target.group->AllReduceAsync(buffer, ReduceOp::kSum);
  in_flight_.push_back({set, bucket, std::move(buffer), std::move(pending)});
}

void OverlappedGradientSum::StartRemaining(
    const std::vector<std::vector<Bucket>>& plans) {
  std::lock_guard<std::mutex> lock(mu_);
  for (Sequence& sequence : sequences_) {
    // Buckets start set by set, so the hooks started a prefix of each set's
    // planned buckets. It is also a prefix of `plans`: every gradient in it
    // exists, and the layout of what precedes a bucket decides the bucket.
    std::vector<size_t> sets;
    std::vector<size_t> started(sets_.size(), 0);
    for (size_t n = 0; n < sequence.order.size(); ++n) {
      const size_t s = sequence.order[n].first;
      if (std::find(sets.begin(), sets.end(), s) == sets.end()) {
        sets.push_back(s);
      }
      if (n < sequence.next) ++started[s];
    }
    for (size_t s : sets) {
      for (size_t b = started[s]; b < plans[s].size(); ++b) {
        Start(s, plans[s][b]);
      }
    }
    sequence.next = sequence.order.size();
  }
}

absl::Status OverlappedGradientSum::WaitForAll() {
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = hook_error_;
  }
  // Every one is waited for, even after an error, so each gets its status;
  // once a group failed (say a rank closed it, ProcessGroups::FailFast), its
  // waits return at once, and the backend keeps its own reference to a
  // buffer it may still write.
  for (InFlight& f : in_flight_) {
    const absl::Status done = f.pending.Wait();
    if (status.ok()) status = done;
  }
  return status;
}

absl::Status OverlappedGradientSum::Finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }
  std::vector<std::vector<Bucket>> plans;
  TALLY_RETURN_IF_ERROR(CatchTorch("collect gradients", [&] {
    for (GradientSet& set : sets_) {
      plans.push_back(LayOutPresentGradients(set.parameters, bucket_bytes_));
    }
  }));
  StartRemaining(plans);
  finished_ = true;
  TALLY_RETURN_IF_ERROR(WaitForAll());
  TALLY_RETURN_IF_ERROR(CatchTorch("unpack gradient buckets", [&] {
    for (const InFlight& f : in_flight_) {
      Unpack(f.bucket, f.buffer, sets_[f.set].parameters);
    }
  }));
  in_flight_.clear();
  return absl::OkStatus();
}

}  // namespace tally
