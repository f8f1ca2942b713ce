// The names of runtime/types.h's enums, one table each (base/enum_names.h):
// what tally.json, flags and logs call them. DTypeName, OptimizerName and the
// like read these; so do parsers that list the accepted names in an error.
//
//   std::optional<GradSync> sync = ValueNamed(kGradSyncNames, "deferred");
//   std::string expected = NameList(kDTypeNames, "\"");
//   // "\"float32\", \"float64\" or \"bfloat16\""
#ifndef TALLY_RUNTIME_TYPE_NAMES_H_
#define TALLY_RUNTIME_TYPE_NAMES_H_

#include "base/dtype_names.h"
#include "base/enum_names.h"
#include "runtime/types.h"

namespace tally {

// A DType has its base/dtype_names.h name (float16 is no DType: only an
// export stores it).
inline constexpr EnumName<DType> kDTypeNames[] = {
    {DType::kFloat32, NameOf(kDataTypeNames, DataType::kFloat32)},
    {DType::kFloat64, NameOf(kDataTypeNames, DataType::kFloat64)},
    {DType::kBFloat16, NameOf(kDataTypeNames, DataType::kBFloat16)},
};
inline constexpr EnumName<OptimizerKind> kOptimizerNames[] = {
    {OptimizerKind::kAdamW, "adamw"},
    {OptimizerKind::kSgd, "sgd"},
};
inline constexpr EnumName<LossReduction> kReductionNames[] = {
    {LossReduction::kTokenMean, "token_mean"},
    {LossReduction::kSampleMean, "sample_mean"},
    {LossReduction::kSum, "sum"},
};
inline constexpr EnumName<GradSync> kGradSyncNames[] = {
    {GradSync::kEager, "eager"},
    {GradSync::kDeferred, "deferred"},
};
inline constexpr EnumName<AttentionMode> kAttentionModeNames[] = {
    {AttentionMode::kAuto, "auto"},
    {AttentionMode::kMaterialized, "materialized"},
    {AttentionMode::kBlocked, "blocked"},
};

}  // namespace tally

#endif  // TALLY_RUNTIME_TYPE_NAMES_H_
