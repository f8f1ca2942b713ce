// ExpectedTensors: the tensors a checkpoint of a model may hold, by name and
// shape, derived from its config (and LoRA config) without allocating the
// model, as screens for ReadSafetensors (runtime/io/safetensors.h). A file
// whose header declares a tensor the model has no place for, or one of another
// shape, is refused before any memory for it exists: a header cannot make
// the server allocate more than the model it describes.
//
//   TALLY_ASSIGN_OR_RETURN(tally::ExpectedTensors expected,
//                          tally::ExpectedTensors::ForModel(config, lora));
//   TALLY_ASSIGN_OR_RETURN(
//       tally::NamedTensors weights,
//       tally::ReadSafetensors(path, nullptr, expected.WeightScreen()));
#ifndef TALLY_RUNTIME_CHECKPOINT_EXPECTED_TENSORS_H_
#define TALLY_RUNTIME_CHECKPOINT_EXPECTED_TENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/config/llama_config.h"
#include "runtime/config/lora_config.h"
#include "runtime/io/safetensors.h"

namespace tally {

// A derived buffer that transformers < 4.31 saved with Llama weights; loading
// ignores it.
inline constexpr char kRotaryBufferSuffix[] = ".rotary_emb.inv_freq";

class ExpectedTensors {
 public:
  // The tensors of the unsharded model `config` describes, with `lora`'s
  // adapters when enabled. INVALID_ARGUMENT when no model can be built from
  // them.
  static absl::StatusOr<ExpectedTensors> ForModel(const LlamaConfig& config,
                                                  const LoraConfig& lora);

  // Weights under HF names, as LoadWeightsInto takes them. INVALID_ARGUMENT
  // naming the tensor for a name no parameter has, or a parameter's name
  // with another shape (the message gives the expected one) or a dtype that
  // is not floating point. A tied model's lm_head.weight and the
  // ".rotary_emb.inv_freq" buffers, which loading ignores, are skipped.
  SafetensorsScreen WeightScreen() const;
  // Optimizer state under Optimizer::StateTensors names: INVALID_ARGUMENT
  // naming the tensor for one of another shape than its parameter; names
  // of no parameter's state are skipped (loading ignores them).
  SafetensorsScreen OptimizerStateScreen() const;
  // PEFT's adapter_model.safetensors: the LoRA factors under kPeftKeyPrefix
  // and their HF names. INVALID_ARGUMENT naming the tensor for any other
  // name, shape or a dtype that is not floating point.
  SafetensorsScreen PeftAdapterScreen() const;

 private:
  using Shapes = std::map<std::string, std::vector<int64_t>>;

  Shapes weights_;     // HF names
  Shapes parameters_;  // tally's parameter names
  Shapes adapters_;    // LoRA factors, HF names
  bool tied_ = false;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_CHECKPOINT_EXPECTED_TENSORS_H_
