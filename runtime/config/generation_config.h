// The generation settings of a model directory that sampling uses, read
// torch-free: the EOS token ids that end a Sample with no stop conditions of
// its own. eos_token_id comes from <dir>/generation_config.json, else from
// <dir>/config.json, as an int or a list of ints (null or absent: none).
//
//   TALLY_ASSIGN_OR_RETURN(std::vector<int64_t> eos,
//                          tally::ReadEosTokenIds(spec.init_checkpoint));
#ifndef TALLY_RUNTIME_CONFIG_GENERATION_CONFIG_H_
#define TALLY_RUNTIME_CONFIG_GENERATION_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tally {

// The EOS token ids `dir` names (above); empty for an empty `dir` or when
// neither file names one. INVALID_ARGUMENT naming the file and field for an
// eos_token_id that is neither a token id (an int >= 0) nor a list of them,
// or for a file that is not a JSON object; a file that exists but cannot be
// read keeps its error.
absl::StatusOr<std::vector<int64_t>> ReadEosTokenIds(const std::string& dir);

}  // namespace tally

#endif  // TALLY_RUNTIME_CONFIG_GENERATION_CONFIG_H_
