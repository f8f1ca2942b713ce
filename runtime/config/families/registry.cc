#include "runtime/config/families/registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json_reader.h"
#include "runtime/config/families/families.h"

namespace tally {
namespace {

const std::vector<const ModelFamily*>& Families() {
  static const auto* families = new std::vector<const ModelFamily*>{
      &LlamaFamily(), &MistralFamily(), &MixtralFamily(), &Qwen2Family(),
      &Qwen3Family()};
  return *families;
}

}  // namespace

absl::StatusOr<const ModelFamily*> FindModelFamily(
    absl::string_view model_type) {
  for (const ModelFamily* family : Families()) {
    if (model_type == family->model_type()) return family;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("config.model_type \"", Excerpt(model_type),
                   "\" is not supported (tally builds ",
                   absl::StrJoin(SupportedModelTypes(), ", "), ")"));
}

std::vector<std::string> SupportedModelTypes() {
  std::vector<std::string> types;
  for (const ModelFamily* family : Families()) {
    types.emplace_back(family->model_type());
  }
  std::sort(types.begin(), types.end());
  return types;
}

}  // namespace tally
