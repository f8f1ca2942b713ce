#include "base/file_text.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace tally {

absl::StatusOr<std::string> ReadFileText(const std::string& path,
                                         absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  if (in) text << in.rdbuf();
  if (!in || in.bad()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot read ", path));
  }
  return text.str();
}

}  // namespace tally
