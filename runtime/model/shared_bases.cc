#include "runtime/model/shared_bases.h"

#include <iterator>

namespace tally {

std::shared_ptr<const CausalLm> SharedBases::Find(
    const std::string& base_key) const {
  auto it = bases_.find(base_key);
  return it == bases_.end() ? nullptr : it->second.lock();
}

std::optional<LlamaConfig> SharedBases::Config(
    const std::string& base_key) const {
  const std::shared_ptr<const CausalLm> base = Find(base_key);
  if (base == nullptr) return std::nullopt;
  return base->config();
}

void SharedBases::Remember(const std::string& base_key, const CausalLm& model) {
  if (model.base() != nullptr) bases_[base_key] = model.base();
}

void SharedBases::ForgetUnshared() {
  for (auto it = bases_.begin(); it != bases_.end();) {
    it = it->second.expired() ? bases_.erase(it) : std::next(it);
  }
}

}  // namespace tally
