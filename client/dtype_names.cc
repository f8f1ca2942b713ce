#include "client/dtype_names.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/dtype_names.h"
#include "base/enum_names.h"

namespace tally {
namespace {

// The base/dtype_names.h row of `dtype`, whose name is the label.
std::optional<DataType> DataTypeOf(v1::DType dtype) {
  return ValueNamed(kDataTypeNames, DTypeLabel(dtype));
}

}  // namespace

std::optional<v1::DType> ProtoDTypeNamed(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  // "DTYPE_BFLOAT16" (any case) is the label with the enum's prefix.
  absl::string_view label = lower;
  const bool prefixed = absl::ConsumePrefix(&label, "dtype_");
  std::optional<DataType> type = ValueNamed(kDataTypeNames, label);
  if (!type.has_value() && !prefixed) {
    type = ValueNamed(kDataTypeShortNames, label);
  }
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  if (!type.has_value() ||
      !v1::DType_Parse(absl::StrCat("DTYPE_", absl::AsciiStrToUpper(NameOf(
                                                  kDataTypeNames, *type))),
                       &dtype)) {
    return std::nullopt;
  }
  return dtype;
}

std::string DTypeLabel(v1::DType dtype) {
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
    if (const std::optional<DataType> type = DataTypeOf(allowed[i])) {
      absl::StrAppend(&text, " (", NameOf(kDataTypeShortNames, *type), ")");
    }
  }
  return absl::StrCat(text, ", any case, or DTYPE_<NAME>");
}

}  // namespace tally
