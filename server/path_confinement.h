// Path confinement: keeps client-supplied checkpoint paths inside a server
// directory. Without LibTorch, so the check can be fuzzed on its own.
//
// A path is confined when it has no ".." component and, after resolving the
// symlinks of its existing part against the real (canonical) root, lies
// strictly below that root and passes no dangling symlink. The result is the
// absolute resolved path, so a later symlink added above it cannot redirect
// what was checked.
//
//   TALLY_ASSIGN_OR_RETURN(std::string dir,
//                          tally::ConfineToRoot("/srv/ckpt", "run1/step-3"));
//   // dir == "/srv/ckpt/run1/step-3" (with /srv/ckpt's symlinks resolved)
#ifndef TALLY_SERVER_PATH_CONFINEMENT_H_
#define TALLY_SERVER_PATH_CONFINEMENT_H_

#include <string>

#include "absl/status/statusor.h"

namespace tally {

// `path` as an absolute path inside `root` (a relative `path` is taken
// relative to `root`): PERMISSION_DENIED when it has a ".." component or
// resolves, through symlinks of its existing part, outside the real `root`
// or goes through a symlink whose target is missing (it could lead
// anywhere); INVALID_ARGUMENT when it holds a NUL byte. `root` must exist.
absl::StatusOr<std::string> ConfineToRoot(const std::string& root,
                                          const std::string& path);

}  // namespace tally

#endif  // TALLY_SERVER_PATH_CONFINEMENT_H_
