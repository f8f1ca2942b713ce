// The dtype spellings tally's clients accept, for tally.v1.DType, read from
// the one table of dtype names (base/dtype_names.h), for tallyctl's --dtype
// flags (the set tally_client, the Python package, accepts too).
// Case-insensitive:
//
//   float32  fp32  DTYPE_FLOAT32
//   float64  fp64  DTYPE_FLOAT64
//   bfloat16 bf16  DTYPE_BFLOAT16
//   float16  fp16  DTYPE_FLOAT16   (storage only: ExportWeights)
//
//   std::optional<tally::v1::DType> dtype = tally::ProtoDTypeNamed("BF16");
//   // *dtype == v1::DTYPE_BFLOAT16; DTypeLabel(*dtype) == "bfloat16"
//   std::string expected = tally::DTypeSpellings(
//       {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16});
//   // "float32 (fp32) or bfloat16 (bf16), any case, or DTYPE_<NAME>"
#ifndef TALLY_CLIENT_DTYPE_NAMES_H_
#define TALLY_CLIENT_DTYPE_NAMES_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

// The DType `name` spells (see above); nullopt for any other name, and for
// DTYPE_UNSPECIFIED, which is no dtype of its own.
std::optional<v1::DType> ProtoDTypeNamed(absl::string_view name);

// The short lower-case name: "float32", "bfloat16"; "unspecified".
std::string DTypeLabel(v1::DType dtype);

// What an error lists for `allowed`: "float32 (fp32), float64 (fp64) or
// bfloat16 (bf16), any case, or DTYPE_<NAME>".
std::string DTypeSpellings(const std::vector<v1::DType>& allowed);

}  // namespace tally

#endif  // TALLY_CLIENT_DTYPE_NAMES_H_
