#include "client/dtype_names.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace tally {
namespace {

struct DTypeSpelling {
  v1::DType dtype;
  const char* label;  // also DType_Name without "DTYPE_", in lower case
  const char* short_name;
};

constexpr DTypeSpelling kSpellings[] = {
    {v1::DTYPE_FLOAT32, "float32", "fp32"},
    {v1::DTYPE_FLOAT64, "float64", "fp64"},
    {v1::DTYPE_BFLOAT16, "bfloat16", "bf16"},
    {v1::DTYPE_FLOAT16, "float16", "fp16"},
};

const DTypeSpelling* SpellingOf(v1::DType dtype) {
  for (const DTypeSpelling& spelling : kSpellings) {
    if (spelling.dtype == dtype) return &spelling;
  }
  return nullptr;
}

}  // namespace

std::optional<v1::DType> ProtoDTypeNamed(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  // "DTYPE_BFLOAT16" (any case) is the label with the enum's prefix.
  absl::string_view label = lower;
  const bool prefixed = absl::ConsumePrefix(&label, "dtype_");
  for (const DTypeSpelling& spelling : kSpellings) {
    if (label == spelling.label ||
        (!prefixed && label == spelling.short_name)) {
      return spelling.dtype;
    }
  }
  return std::nullopt;
}

std::string DTypeLabel(v1::DType dtype) {
  if (const DTypeSpelling* spelling = SpellingOf(dtype)) return spelling->label;
  return absl::AsciiStrToLower(
      absl::StripPrefix(v1::DType_Name(dtype), "DTYPE_"));
}

std::string DTypeSpellings(const std::vector<v1::DType>& allowed) {
  std::string text;
  for (size_t i = 0; i < allowed.size(); ++i) {
    const char* separator = i == 0                    ? ""
                            : i + 1 == allowed.size() ? " or "
                                                      : ", ";
    absl::StrAppend(&text, separator, DTypeLabel(allowed[i]));
    if (const DTypeSpelling* spelling = SpellingOf(allowed[i])) {
      absl::StrAppend(&text, " (", spelling->short_name, ")");
    }
  }
  return absl::StrCat(text, ", any case, or DTYPE_<NAME>");
}

}  // namespace tally
