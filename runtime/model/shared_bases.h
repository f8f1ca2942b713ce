// SharedBases: the frozen bases that adapter models (LoRA) share, by BaseKey
// (runtime/checkpoint/directory_identity.h), alive while some model shares
// them. A build asks it for the base of its key (one in memory is neither read
// nor built again); the engine tells it of every model it adds and, after a
// delete, forgets the bases no model shares any longer.
//
//   tally::SharedBases bases;
//   std::shared_ptr<const tally::CausalLm> base = bases.Find(key);
//   ... build the model, over `base` when it is set ...
//   bases.Remember(key, model);
//   ... delete the model ...
//   bases.ForgetUnshared();
#ifndef TALLY_RUNTIME_MODEL_SHARED_BASES_H_
#define TALLY_RUNTIME_MODEL_SHARED_BASES_H_

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "runtime/config/llama_config.h"
#include "runtime/model/causal_lm.h"

namespace tally {

class SharedBases {
 public:
  // The base of `base_key` while a model shares it, else nullptr.
  std::shared_ptr<const CausalLm> Find(const std::string& base_key) const;
  // Its config while it is in memory: what a model created with `base_key`
  // is built on.
  std::optional<LlamaConfig> Config(const std::string& base_key) const;
  // Registers the base `model` (built with `base_key`) shares; nothing for a
  // model without one.
  void Remember(const std::string& base_key, const CausalLm& model);
  // Forgets the bases whose last model is gone.
  void ForgetUnshared();

 private:
  std::map<std::string, std::weak_ptr<const CausalLm>> bases_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_MODEL_SHARED_BASES_H_
