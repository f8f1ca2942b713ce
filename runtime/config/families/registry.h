// The registry of model families: which ModelFamily (model_family.h) a
// config.json "model_type" names. Each family is one file beside this one
// (families.h declares them); adding one is one entry in registry.cc.
// LlamaConfig asks it for its family, so neither this header nor
// model_family.h includes llama_config.h.
//
//   TALLY_ASSIGN_OR_RETURN(const tally::ModelFamily* family,
//                          tally::FindModelFamily(config.ResolvedModelType()));
//   tally::ModelFeatures features = family->Features(config);
#ifndef TALLY_RUNTIME_CONFIG_FAMILIES_REGISTRY_H_
#define TALLY_RUNTIME_CONFIG_FAMILIES_REGISTRY_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/config/model_family.h"

namespace tally {

// NOT_FOUND-free lookup: INVALID_ARGUMENT naming config.model_type and the
// supported families when `model_type` is none of them.
absl::StatusOr<const ModelFamily*> FindModelFamily(
    absl::string_view model_type);
// The supported model_type strings, sorted.
std::vector<std::string> SupportedModelTypes();

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_FAMILIES_REGISTRY_H_
