// Sampler snapshots: named, frozen copies of a model's weights that Sample
// and ComputeLogprobs can read instead of the live ones (Tinker's
// save_weights_for_sampler). A SamplerSnapshot holds what this rank holds of
// the model — its local shard of every parameter (tp, pp, dp_shard, ep
// layouts alike) and, under ZeRO stages 1 and 2, the gathered copy kept
// between steps — so a decode over it runs exactly as over the live
// weights, collectives included. A LoRA model's snapshot copies the adapter
// alone: the frozen base it shares never changes. SwappedInWeights puts a
// snapshot's tensors in the model's place for the duration of a call and
// puts the live ones back; SamplerSnapshots is one model's set, by name.
//
//   TALLY_ASSIGN_OR_RETURN(tally::SamplerSnapshot snapshot,
//                          tally::SamplerSnapshot::Take(model, step));
//   {
//     tally::SwappedInWeights swapped(model, snapshot);
//     ... Decode(model, request, groups) ...  // reads the snapshot
//   }  // the live weights again
#ifndef TALLY_RUNTIME_ENGINE_SAMPLER_SNAPSHOTS_H_
#define TALLY_RUNTIME_ENGINE_SAMPLER_SNAPSHOTS_H_

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/config/sampler_name.h"
#include "runtime/model/causal_lm.h"
#include "runtime/parallel/parameter.h"

namespace tally {

class SamplerSnapshot {
 public:
  // Copies what this rank holds of `model`'s weights (a LoRA model's
  // adapter parameters alone), detached, as of `step`. INTERNAL when a copy
  // fails (an allocation); nothing is kept then.
  static absl::StatusOr<SamplerSnapshot> Take(const CausalLm& model,
                                              int64_t step);

  int64_t step() const { return step_; }
  uint64_t bytes() const { return bytes_; }
  absl::Time created() const { return created_; }
  bool is_adapter() const { return is_adapter_; }

 private:
  friend class SwappedInWeights;
  // One parameter's frozen state: its local tensor and, when the model keeps
  // it gathered between steps, a gathered copy of its own.
  struct Frozen {
    size_t index = 0;  // into CausalLm::parameters()
    torch::Tensor tensor;
    std::shared_ptr<GatheredCopy> gathered;
  };

  std::vector<Frozen> frozen_;
  int64_t step_ = 0;
  uint64_t bytes_ = 0;
  absl::Time created_;
  bool is_adapter_ = false;
};

// While it lives, `model` computes with `snapshot`'s tensors in place of the
// ones it copied; the destructor puts the live tensors back. The model must
// be the one the snapshot was taken of and must not train meanwhile (the
// engine runs one command at a time).
class SwappedInWeights {
 public:
  SwappedInWeights(CausalLm& model, const SamplerSnapshot& snapshot);
  ~SwappedInWeights();
  SwappedInWeights(const SwappedInWeights&) = delete;
  SwappedInWeights& operator=(const SwappedInWeights&) = delete;

 private:
  CausalLm& model_;
  // The live state of each swapped parameter, by index.
  std::vector<SamplerSnapshot::Frozen> live_;
};

// One model's snapshots by name.
class SamplerSnapshots {
 public:
  // ALREADY_EXISTS naming `name` when the model has a snapshot of that name.
  absl::Status CheckNew(const std::string& model_id,
                        const std::string& name) const;
  void Add(const std::string& name, SamplerSnapshot snapshot);
  // NOT_FOUND naming the sampler and the model.
  absl::StatusOr<const SamplerSnapshot*> Find(const std::string& model_id,
                                              const std::string& name) const;
  // Removes it (its memory goes with it) and returns what it was.
  absl::StatusOr<SamplerSummary> Remove(const std::string& model_id,
                                        const std::string& name);
  // By name.
  std::vector<SamplerSummary> List(const std::string& model_id) const;
  size_t size() const { return snapshots_.size(); }

 private:
  std::map<std::string, SamplerSnapshot> snapshots_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_ENGINE_SAMPLER_SNAPSHOTS_H_
