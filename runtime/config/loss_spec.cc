#include "runtime/config/loss_spec.h"

#include <cmath>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "runtime/config/loss_id.h"

namespace tally {
namespace {

using Settings = std::map<std::string, double>;

struct Setting {
  const char* key;
  std::optional<double> fallback;  // nullopt: required
};

struct LossEntry {
  LossId id;
  const char* name;
  std::vector<Setting> settings;
  // Range checks across the settings, once all are known.
  absl::Status (*check)(const Settings& settings);
};

absl::Status NoCheck(const Settings&) { return absl::OkStatus(); }

absl::Status CheckClipRange(const Settings& s) {
  const double low = s.at("clip_low_threshold");
  const double high = s.at("clip_high_threshold");
  if (low < 0 || low > high) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_fn_config: clip_low_threshold (", low,
                     ") must be >= 0 and <= clip_high_threshold (", high, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckBeta(const Settings& s) {
  if (s.at("beta") < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss_fn_config[\"beta\"] = ", s.at("beta"), " must be >= 0"));
  }
  return absl::OkStatus();
}

// The loss table: a row per LossId, in id order (LossSpecTest checks both).
const std::vector<LossEntry>& Losses() {
  static const auto* const kLosses = new std::vector<LossEntry>{
      {LossId::kCrossEntropy, "cross_entropy", {}, &NoCheck},
      {LossId::kImportanceSampling, "importance_sampling", {}, &NoCheck},
      {LossId::kPpo,
       "ppo",
       {{"clip_low_threshold", 0.8}, {"clip_high_threshold", 1.2}},
       &CheckClipRange},
      {LossId::kCispo,
       "cispo",
       {{"clip_low_threshold", 0.8}, {"clip_high_threshold", 1.2}},
       &CheckClipRange},
      {LossId::kDro, "dro", {{"beta", std::nullopt}}, &CheckBeta},
  };
  return *kLosses;
}

absl::StatusOr<Settings> ReadSettings(const LossEntry& loss,
                                      const Settings& config) {
  Settings settings;
  std::vector<std::string> keys;
  for (const Setting& setting : loss.settings) {
    keys.push_back(setting.key);
    const auto it = config.find(setting.key);
    if (it == config.end() && !setting.fallback.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("loss_fn_config[\"", setting.key,
                       "\"] is required by the ", loss.name, " loss"));
    }
    const double value = it != config.end() ? it->second : *setting.fallback;
    if (!std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("loss_fn_config[\"", setting.key, "\"] = ", value,
                       " must be finite"));
    }
    settings[setting.key] = value;
  }
  for (const auto& [key, value] : config) {
    if (settings.count(key) > 0) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "loss_fn_config[\"", key, "\"] is not a setting of the ", loss.name,
        " loss (",
        keys.empty() ? "it has none"
                     : absl::StrCat("it has ", absl::StrJoin(keys, ", ")),
        ")"));
  }
  return settings;
}

// The row of the loss named `name`.
absl::StatusOr<const LossEntry*> FindLoss(absl::string_view name) {
  for (const LossEntry& loss : Losses()) {
    if (name == loss.name) return &loss;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("loss_fn: '", name, "' is not one of ",
                   absl::StrJoin(LossNames(), ", ")));
}

}  // namespace

absl::StatusOr<LossSpec> ParseLossSpec(absl::string_view name,
                                       const Settings& config) {
  TALLY_ASSIGN_OR_RETURN(const LossEntry* loss, FindLoss(name));
  LossSpec spec;
  spec.name = loss->name;
  TALLY_ASSIGN_OR_RETURN(spec.settings, ReadSettings(*loss, config));
  TALLY_RETURN_IF_ERROR(loss->check(spec.settings));
  return spec;
}

const char* LossName(LossId id) {
  for (const LossEntry& loss : Losses()) {
    if (loss.id == id) return loss.name;
  }
  return "";  // a LossId without a row, which LossSpecTest refuses
}

absl::StatusOr<LossId> LossIdOf(absl::string_view name) {
  TALLY_ASSIGN_OR_RETURN(const LossEntry* loss, FindLoss(name));
  return loss->id;
}

std::vector<std::string> LossNames() {
  std::vector<std::string> names;
  for (const LossEntry& loss : Losses()) names.push_back(loss.name);
  return names;
}

}  // namespace tally
