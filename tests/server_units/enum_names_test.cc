// base/enum_names.h, and the tables built on it: each name read back to its
// value, no name twice, and the lists error messages quote.
#include "base/enum_names.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "base/dtype_names.h"
#include "runtime/config/types.h"

namespace tally {
namespace {

enum class Color { kRed, kGreen, kBlue };
constexpr EnumName<Color> kColorNames[] = {
    {Color::kRed, "red"}, {Color::kGreen, "green"}, {Color::kBlue, "blue"}};

TEST(EnumNamesTest, ReadsBothWays) {
  EXPECT_STREQ(NameOf(kColorNames, Color::kGreen), "green");
  EXPECT_EQ(ValueNamed(kColorNames, "blue"), Color::kBlue);
  EXPECT_EQ(ValueNamed(kColorNames, "Blue"), std::nullopt) << "exact case";
  EXPECT_EQ(ValueNamed(kColorNames, ""), std::nullopt);
  EXPECT_STREQ(NameOf(kColorNames, static_cast<Color>(7)), "unknown");
}

TEST(EnumNamesTest, ListsTheNamesForAnError) {
  EXPECT_EQ(NameList(kColorNames), "red, green or blue");
  EXPECT_EQ(NameList(kColorNames, "'"), "'red', 'green' or 'blue'");
  constexpr EnumName<Color> kOne[] = {{Color::kRed, "red"}};
  EXPECT_EQ(NameList(kOne), "red");
}

// Every value of `table` is read back from its name, and no name is there
// twice.
template <typename Enum, size_t N>
void ExpectOneToOne(const EnumName<Enum> (&table)[N]) {
  std::set<std::string> names;
  for (const EnumName<Enum>& entry : table) {
    EXPECT_TRUE(names.insert(entry.name).second) << entry.name;
    EXPECT_EQ(ValueNamed(table, entry.name), entry.value) << entry.name;
    EXPECT_STREQ(NameOf(table, entry.value), entry.name);
  }
}

TEST(EnumNamesTest, EveryTableIsOneToOne) {
  ExpectOneToOne(kDataTypeNames);
  ExpectOneToOne(kDataTypeShortNames);
  ExpectOneToOne(kDTypeNames);
  ExpectOneToOne(kOptimizerNames);
  ExpectOneToOne(kReductionNames);
  ExpectOneToOne(kGradSyncNames);
  ExpectOneToOne(kAttentionModeNames);
}

TEST(EnumNamesTest, TheRuntimeDTypesAreNamedAsInTheDTypeTable) {
  EXPECT_EQ(NameList(kDTypeNames), "float32, float64 or bfloat16");
  EXPECT_EQ(DTypeName(DType::kBFloat16), std::string("bfloat16"));
  EXPECT_EQ(DTypeNamed("float16"), std::nullopt) << "no DType of its own";
  EXPECT_EQ(ValueNamed(kDataTypeNames, "float16"), DataType::kFloat16);
}

}  // namespace
}  // namespace tally
