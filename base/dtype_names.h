// The names of tally's data types, one table for every part of tally: the
// runtime's DType (runtime/config/types.h: no float16, which only an export
// stores), the clients' spellings of tally.v1.DType (client/dtype_names.h:
// also the short names and DTYPE_<NAME>), and the Python client's
// (tally_client/dtypes.py; tests/python/test_dtype_names.py compares them).
//
//   NameOf(kDataTypeNames, DataType::kBFloat16)       // "bfloat16"
//   NameOf(kDataTypeShortNames, DataType::kBFloat16)  // "bf16"
//   ValueNamed(kDataTypeNames, "float16")             // DataType::kFloat16
#ifndef TALLY_BASE_DTYPE_NAMES_H_
#define TALLY_BASE_DTYPE_NAMES_H_

#include "base/enum_names.h"

namespace tally {

enum class DataType { kFloat32, kFloat64, kBFloat16, kFloat16 };

// The name: config.json's torch_dtype, tally.json's dtype, tallyctl's
// labels, and tally.v1.DType's name without DTYPE_, in lower case.
inline constexpr EnumName<DataType> kDataTypeNames[] = {
    {DataType::kFloat32, "float32"},
    {DataType::kFloat64, "float64"},
    {DataType::kBFloat16, "bfloat16"},
    {DataType::kFloat16, "float16"},
};

// The short name the clients accept as well.
inline constexpr EnumName<DataType> kDataTypeShortNames[] = {
    {DataType::kFloat32, "fp32"},
    {DataType::kFloat64, "fp64"},
    {DataType::kBFloat16, "bf16"},
    {DataType::kFloat16, "fp16"},
};

}  // namespace tally

#endif  // TALLY_BASE_DTYPE_NAMES_H_
