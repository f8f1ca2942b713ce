// One table per set of names: an enum's values and their stable names
// (flags, config files, logs, error messages), kept as one constexpr array of
// {value, name} pairs, read both ways. Torch-free and header-only.
//
//   enum class Color { kRed, kGreen };
//   inline constexpr EnumName<Color> kColorNames[] = {
//       {Color::kRed, "red"}, {Color::kGreen, "green"}};
//
//   NameOf(kColorNames, Color::kGreen)    // "green"
//   ValueNamed(kColorNames, "red")        // Color::kRed; nullopt for "blue"
//   NameList(kColorNames)                 // "red or green"
//   NameList(kColorNames, "\"")           // "\"red\" or \"green\""
#ifndef TALLY_BASE_ENUM_NAMES_H_
#define TALLY_BASE_ENUM_NAMES_H_

#include <cstddef>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace tally {

template <typename Enum>
struct EnumName {
  Enum value;
  const char* name;
};

// The name `table` gives `value`; "unknown" for a value it does not list.
template <typename Enum, size_t N>
constexpr const char* NameOf(const EnumName<Enum> (&table)[N], Enum value) {
  for (const EnumName<Enum>& entry : table) {
    if (entry.value == value) return entry.name;
  }
  return "unknown";
}

// The value `table` calls `name` (exactly, case-sensitive); nullopt for any
// other name.
template <typename Enum, size_t N>
constexpr std::optional<Enum> ValueNamed(const EnumName<Enum> (&table)[N],
                                         absl::string_view name) {
  for (const EnumName<Enum>& entry : table) {
    if (name == entry.name) return entry.value;
  }
  return std::nullopt;
}

// The names of `table` in its order, for an error message: "a, b or c", each
// between `quote`s.
template <typename Enum, size_t N>
std::string NameList(const EnumName<Enum> (&table)[N],
                     absl::string_view quote = "") {
  std::string text;
  for (size_t i = 0; i < N; ++i) {
    absl::StrAppend(&text,
                    i == 0       ? ""
                    : i + 1 == N ? " or "
                                 : ", ",
                    quote, table[i].name, quote);
  }
  return text;
}

}  // namespace tally

#endif  // TALLY_BASE_ENUM_NAMES_H_
