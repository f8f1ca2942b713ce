// Models root: base models named as Tinker and the HF hub name them
// ("Qwen/Qwen3-8B") in a local models store (--models-root), found in the
// two layouts such stores use:
//   - the HF hub cache: <root>/models--Org--Name/snapshots/<rev>/, the rev
//     named by <root>/models--Org--Name/refs/main when that file exists,
//     else the only snapshot;
//   - plain folders: <root>/Org/Name/ (or <root>/Name/) holding config.json.
// Names are one or two components of letters, digits, '.', '_' and '-', not
// starting with '.', so a name cannot climb out of the root; the directory
// found is confined to it (ConfineToRoot), symlinks included.
//
//   TALLY_ASSIGN_OR_RETURN(std::optional<std::string> dir,
//                          tally::ResolveModelName("/models",
//                          "Qwen/Qwen3-8B"));
//   if (dir) spec.init_checkpoint = *dir;   // else: not a model of the root
//   std::vector<std::string> names = tally::ListModelNames("/models");
#ifndef TALLY_SERVER_MODELS_ROOT_H_
#define TALLY_SERVER_MODELS_ROOT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tally {

// The directory of the model `name` in `root`; nullopt when `name` is not a
// model name or names no model there. FAILED_PRECONDITION for a hub-cache
// entry with several snapshots and no refs/main, or a refs/main naming a
// missing snapshot; INVALID_ARGUMENT (naming init_checkpoint) when the
// directory resolves outside the root.
absl::StatusOr<std::optional<std::string>> ResolveModelName(
    const std::string& root, const std::string& name);

// The names of the models in `root` (both layouts), sorted and unique.
std::vector<std::string> ListModelNames(const std::string& root);

}  // namespace tally

#endif  // TALLY_SERVER_MODELS_ROOT_H_
