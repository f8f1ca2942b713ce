// Bucketed gradient all-reduce: the data-parallel gradient sum with one
// collective per flat bucket instead of one per parameter.
//
// The gradients of one dtype are laid end to end, in parameter order, and cut
// into buckets of `bucket_bytes`; each bucket is copied into a flat buffer,
// all-reduced (SUM) and copied back. A gradient may straddle two buckets, so
// a sync issues exactly ceil(bytes / bucket_bytes) all-reduces per dtype, and
// every element is summed exactly as a per-parameter all-reduce sums it.
//
//   TALLY_RETURN_IF_ERROR(tally::AllReduceGradientsInBuckets(
//       model.parameters(), *groups.dp_replicate, int64_t{25} << 20));
#ifndef TALLY_RUNTIME_GRAD_BUCKETS_H_
#define TALLY_RUNTIME_GRAD_BUCKETS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "runtime/communicator.h"
#include "runtime/llama_model.h"

namespace tally {

// Sums every defined `.grad` of `parameters` over `group` in place (an
// undefined gradient takes no part, so every rank must have the same ones
// defined). INVALID_ARGUMENT for bucket_bytes < 1; a collective's error is
// returned as is, with the gradients of unfinished buckets unspecified.
absl::Status AllReduceGradientsInBuckets(std::vector<Parameter>& parameters,
                                         Communicator& group,
                                         int64_t bucket_bytes);

}  // namespace tally

#endif  // TALLY_RUNTIME_GRAD_BUCKETS_H_
