#include "client/dtype_names.h"

#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tally {
namespace {

TEST(DTypeNamesTest, EverySpellingInAnyCaseNamesItsDType) {
  struct Case {
    const char* name;
    v1::DType dtype;
  };
  for (const Case& c :
       {Case{"float32", v1::DTYPE_FLOAT32}, Case{"FP32", v1::DTYPE_FLOAT32},
        Case{"DTYPE_FLOAT32", v1::DTYPE_FLOAT32},
        Case{"Float64", v1::DTYPE_FLOAT64}, Case{"fp64", v1::DTYPE_FLOAT64},
        Case{"dtype_float64", v1::DTYPE_FLOAT64},
        Case{"bfloat16", v1::DTYPE_BFLOAT16}, Case{"BF16", v1::DTYPE_BFLOAT16},
        Case{"bF16", v1::DTYPE_BFLOAT16},
        Case{"DTYPE_BFLOAT16", v1::DTYPE_BFLOAT16},
        Case{"float16", v1::DTYPE_FLOAT16}, Case{"FP16", v1::DTYPE_FLOAT16},
        Case{"DTYPE_FLOAT16", v1::DTYPE_FLOAT16}}) {
    EXPECT_EQ(ProtoDTypeNamed(c.name), std::optional<v1::DType>(c.dtype))
        << c.name;
  }
}

TEST(DTypeNamesTest, OtherNamesAndUnspecifiedAreNoDType) {
  for (const char* name :
       {"", "int8", "float", "half", "bfloat", "fp8", "DTYPE_BF16", "dtype_",
        "DTYPE_UNSPECIFIED", "unspecified", " float32", "float32 "}) {
    EXPECT_EQ(ProtoDTypeNamed(name), std::nullopt) << "'" << name << "'";
  }
}

TEST(DTypeNamesTest, LabelsRoundTripThroughTheParser) {
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT64,
                          v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16}) {
    const std::string label = DTypeLabel(dtype);
    EXPECT_EQ(ProtoDTypeNamed(label), std::optional<v1::DType>(dtype)) << label;
    EXPECT_EQ(ProtoDTypeNamed(v1::DType_Name(dtype)),
              std::optional<v1::DType>(dtype));
  }
  EXPECT_EQ(DTypeLabel(v1::DTYPE_BFLOAT16), "bfloat16");
  EXPECT_EQ(DTypeLabel(v1::DTYPE_UNSPECIFIED), "unspecified");
}

TEST(DTypeNamesTest, SpellingsListTheAllowedDTypesWithTheirShortNames) {
  EXPECT_EQ(DTypeSpellings(
                {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT64, v1::DTYPE_BFLOAT16}),
            "float32 (fp32), float64 (fp64) or bfloat16 (bf16), any case, or "
            "DTYPE_<NAME>");
  EXPECT_EQ(DTypeSpellings({v1::DTYPE_FLOAT16}),
            "float16 (fp16), any case, or DTYPE_<NAME>");
}

}  // namespace
}  // namespace tally
