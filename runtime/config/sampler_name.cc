#include "runtime/config/sampler_name.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace tally {
namespace {

constexpr size_t kMaxSamplerNameLength = 128;

}  // namespace

absl::Status ValidateSamplerName(const std::string& name,
                                 const std::string& field) {
  if (name.empty() || name.size() > kMaxSamplerNameLength) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be 1 to ", kMaxSamplerNameLength,
                     " characters, got ", name.size()));
  }
  const bool allowed = std::all_of(name.begin(), name.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
           c == '_' || c == '-';
  });
  if (!allowed || name == "." || name == "..") {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " '", name,
        "' must be letters, digits, '.', '_' and '-', not '.' or '..'"));
  }
  return absl::OkStatus();
}

}  // namespace tally
