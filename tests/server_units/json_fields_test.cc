// base/json_reader.h's JsonFields: the typed field readers of every JSON
// file tally reads, with errors naming the file and the field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "base/enum_names.h"
#include "base/json_reader.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

const nlohmann::json kObject = nlohmann::json::parse(R"({
  "count": 7, "negative": -3, "huge": 18446744073709551615,
  "ratio": 0.5, "name": "red", "flag": true, "nothing": null,
  "inner": {"depth": 2}
})");

JsonFields Fields(const nlohmann::json& object = kObject,
                  std::string prefix = "") {
  return JsonFields(object, "f.json: ", absl::StatusCode::kDataLoss,
                    std::move(prefix));
}

TEST(JsonFieldsTest, ReadsRequiredFields) {
  int64_t count = 0;
  double ratio = 0;
  std::string name;
  bool flag = false;
  uint64_t huge = 0;
  EXPECT_TRUE(Fields().NonNegativeInt("count", count).ok());
  EXPECT_TRUE(Fields().Double("ratio", ratio).ok());
  EXPECT_TRUE(Fields().String("name", name).ok());
  EXPECT_TRUE(Fields().Bool("flag", flag).ok());
  EXPECT_TRUE(Fields().Unsigned("huge", huge).ok());
  EXPECT_EQ(count, 7);
  EXPECT_EQ(ratio, 0.5);
  EXPECT_EQ(name, "red");
  EXPECT_TRUE(flag);
  EXPECT_EQ(huge, UINT64_MAX);
  double as_double = 0;
  EXPECT_TRUE(Fields().Double("count", as_double).ok()) << "an int is a number";
  EXPECT_EQ(as_double, 7.0);
}

TEST(JsonFieldsTest, ARequiredFieldIsRefusedNamingTheFileAndField) {
  int64_t value = 0;
  const absl::Status missing = Fields().NonNegativeInt("absent", value);
  EXPECT_EQ(missing.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(missing.message(), "f.json: absent is missing or not an integer");
  EXPECT_EQ(Fields().NonNegativeInt("negative", value).message(),
            "f.json: negative is missing or not a non-negative integer");
  EXPECT_EQ(Fields().NonNegativeInt("huge", value).message(),
            "f.json: huge is missing or not a non-negative integer");
  int small = 0;
  EXPECT_EQ(Fields().NonNegativeInt("huge", small).code(),
            absl::StatusCode::kDataLoss);
  std::string text;
  EXPECT_EQ(Fields().String("count", text).message(),
            "f.json: count is missing or not a string");
  bool flag = false;
  EXPECT_EQ(Fields().Bool("nothing", flag).message(),
            "f.json: nothing is missing or not a boolean");
  EXPECT_EQ(value, 0) << "a refused field leaves the output";
}

TEST(JsonFieldsTest, APrefixNamesTheInnerObject) {
  int64_t depth = 0;
  const JsonFields inner = Fields(kObject["inner"], "inner.");
  EXPECT_TRUE(inner.NonNegativeInt("depth", depth).ok());
  EXPECT_EQ(depth, 2);
  double width = 0;
  EXPECT_EQ(inner.Double("width", width).message(),
            "f.json: inner.width is missing or not a number");
}

TEST(JsonFieldsTest, OptionalFieldsLeaveTheOutputWhenAbsentOrNull) {
  int64_t count = 42;
  double ratio = 1.5;
  bool flag = false;
  for (const char* key : {"absent", "nothing"}) {
    EXPECT_TRUE(Fields().OptionalInt(key, count).ok()) << key;
    EXPECT_TRUE(Fields().OptionalDouble(key, ratio).ok()) << key;
    EXPECT_TRUE(Fields().OptionalBool(key, flag).ok()) << key;
  }
  EXPECT_EQ(count, 42);
  EXPECT_EQ(ratio, 1.5);
  EXPECT_FALSE(flag);
  EXPECT_TRUE(Fields().OptionalInt("negative", count).ok());
  EXPECT_EQ(count, -3);
}

TEST(JsonFieldsTest, AnOptionalFieldOfAnotherKindIsRefused) {
  int64_t count = 0;
  bool flag = false;
  EXPECT_EQ(Fields().OptionalInt("ratio", count).message(),
            "f.json: ratio must be an integer");
  EXPECT_EQ(Fields().OptionalInt("huge", count).message(),
            "f.json: huge is out of range: 18446744073709551615");
  EXPECT_EQ(Fields().OptionalBool("name", flag).message(),
            "f.json: name must be a boolean");
  double ratio = 0;
  EXPECT_EQ(Fields().OptionalDouble("name", ratio).message(),
            "f.json: name must be a number");
}

enum class Shade { kRed, kGreen };
constexpr EnumName<Shade> kShadeNames[] = {{Shade::kRed, "red"},
                                           {Shade::kGreen, "green"}};

TEST(JsonFieldsTest, ANamedFieldIsOneOfTheTablesNames) {
  Shade color = Shade::kGreen;
  EXPECT_TRUE(Fields().Named("name", kShadeNames, color).ok());
  EXPECT_EQ(color, Shade::kRed);
  EXPECT_EQ(Fields().Named("count", kShadeNames, color).message(),
            "f.json: count is missing or not \"red\" or \"green\"");
  const nlohmann::json blue = {{"name", "blue"}};
  EXPECT_THAT(Fields(blue).Named("name", kShadeNames, color).message(),
              HasSubstr("\"red\" or \"green\""));
}

}  // namespace
}  // namespace tally
