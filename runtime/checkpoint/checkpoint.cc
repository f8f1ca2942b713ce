#include "runtime/checkpoint/checkpoint.h"

#include <algorithm>
#include <exception>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/file_text.h"
#include "base/json_reader.h"
#include "base/status.h"
#include "runtime/checkpoint/expected_tensors.h"
#include "runtime/io/atomic_directory.h"
#include "runtime/io/shard_index.h"
#include "runtime/parallel/fault_hook.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

constexpr char kOptimizerFile[] = "optimizer.safetensors";
constexpr char kManifestFile[] = "tally.json";
constexpr char kServerStateFile[] = "server_state.bin";
// checksums.sha256: one 67-byte line per file, plus its name.
constexpr uint64_t kMaxChecksumFileBytes = uint64_t{1} << 20;
// server_state.bin: the sequencer's kept responses, at most its cache_bytes
// (256 MiB by default) beyond the current and the previous window's; a
// bound far above that refuses a damaged size before allocating it.
constexpr uint64_t kMaxServerStateBytes = uint64_t{4} << 30;

std::string PathIn(const std::string& dir, const char* file) {
  return (fs::path(dir) / file).string();
}

bool IsFile(const std::string& path) {
  std::error_code ignored;
  return fs::is_regular_file(path, ignored);
}

absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& path) {
  TALLY_ASSIGN_OR_RETURN(const std::string text,
                         ReadFileUpTo(path, kConfigJsonLimits.max_bytes,
                                      absl::StatusCode::kDataLoss));
  return ParseCheckpointManifest(text, path);
}

}  // namespace

absl::StatusOr<std::optional<CheckpointManifest>> ReadManifestIfAny(
    const std::string& dir) {
  const std::string path = PathIn(PublishedDir(dir), kManifestFile);
  if (!IsFile(path)) return std::nullopt;
  return ReadManifest(path);
}

absl::StatusOr<LlamaConfig> ReadHfConfig(const std::string& path) {
  if (!IsFile(path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is missing"));
  }
  TALLY_ASSIGN_OR_RETURN(const std::string text,
                         ReadFileUpTo(path, kConfigJsonLimits.max_bytes,
                                      absl::StatusCode::kInvalidArgument));
  absl::StatusOr<LlamaConfig> config;
  try {
    config = LlamaConfig::FromHfJson(text);
  } catch (const std::exception& e) {
    // A field of the wrong JSON type can surface as a json exception.
    config = absl::InvalidArgumentError(e.what());
  }
  if (!config.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", config.status().message()));
  }
  return config;
}

namespace {

// The checksums.sha256 of a checkpoint directory; a directory without one
// verifies nothing.
class Checksums {
 public:
  // Parses `<dir>/checksums.sha256` when present and checks that every file
  // it lists exists.
  static absl::StatusOr<Checksums> Read(const std::string& dir) {
    Checksums sums;
    sums.dir_ = dir;
    const std::string path = PathIn(dir, kChecksumFile);
    if (!IsFile(path)) return sums;
    TALLY_ASSIGN_OR_RETURN(
        std::string text,
        ReadFileUpTo(path, kMaxChecksumFileBytes, absl::StatusCode::kDataLoss));
    sums.present_ = true;
    for (absl::string_view line :
         absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      // `sha256sum` format: 64 hex digits, two spaces, the file name.
      const bool well_formed =
          line.size() > 66 && line.substr(64, 2) == "  " &&
          std::all_of(line.begin(), line.begin() + 64, [](char c) {
            return absl::ascii_isxdigit(c) && !absl::ascii_isupper(c);
          });
      const std::string file(well_formed ? line.substr(66) : "");
      if (!well_formed || file == "." || file == ".." ||
          file.find('/') != std::string::npos) {
        return absl::DataLossError(
            absl::StrCat(path, ": malformed line \"", Excerpt(line), "\""));
      }
      if (!sums.digests_.emplace(file, std::string(line.substr(0, 64)))
               .second) {
        return absl::DataLossError(
            absl::StrCat(path, " lists ", file, " twice"));
      }
      if (!IsFile(PathIn(dir, file.c_str()))) {
        return absl::DataLossError(absl::StrCat(
            path, " lists ", file, ", which is missing from ", dir));
      }
    }
    return sums;
  }

  bool present() const { return present_; }
  const std::map<std::string, std::string>& digests() const { return digests_; }

  // OK when there is no list, or `file` is listed with its current digest.
  absl::Status Verify(const std::string& file) const {
    if (!present_) return absl::OkStatus();
    const std::string path = PathIn(dir_, file.c_str());
    const auto it = digests_.find(file);
    if (it == digests_.end()) {
      return absl::DataLossError(absl::StrCat(path, " is not covered by ",
                                              kChecksumFile,
                                              " in the same directory"));
    }
    TALLY_ASSIGN_OR_RETURN(std::string digest, Sha256OfFile(path));
    if (digest != it->second) {
      return absl::DataLossError(
          absl::StrCat(path, " is corrupt or truncated: its SHA-256 is ",
                       digest, ", ", kChecksumFile, " records ", it->second));
    }
    return absl::OkStatus();
  }

 private:
  std::string dir_;
  bool present_ = false;
  std::map<std::string, std::string> digests_;
};

// HF's sharded layout: the index maps each tensor name to its shard file.
// A shard's tensors the index does not place in it are not read.
absl::StatusOr<NamedTensors> ReadShardedWeights(
    const std::string& dir, const std::string& index_path,
    const Checksums& sums, const ExpectedTensors& expected) {
  TALLY_RETURN_IF_ERROR(sums.Verify(kShardIndexFile));
  TALLY_ASSIGN_OR_RETURN(
      const std::string text,
      ReadFileUpTo(index_path, kShardIndexJsonLimits.max_bytes,
                   absl::StatusCode::kDataLoss));
  TALLY_ASSIGN_OR_RETURN(const ShardIndex index,
                         ParseShardIndex(text, index_path));
  const SafetensorsScreen weight_screen = expected.WeightScreen();
  NamedTensors weights;
  for (const auto& [file, names] : index) {
    const std::string path = (fs::path(dir) / file).string();
    if (!IsFile(path)) {
      return absl::DataLossError(absl::StrCat(
          index_path, " names shard ", Excerpt(path), ", which is missing"));
    }
    TALLY_RETURN_IF_ERROR(sums.Verify(file));
    auto screen =
        [&, &names = names](
            const SafetensorsEntry& entry) -> absl::StatusOr<ScreenVerdict> {
      if (names.count(entry.name) == 0) return ScreenVerdict::kSkip;
      return weight_screen(entry);
    };
    TALLY_ASSIGN_OR_RETURN(NamedTensors tensors,
                           ReadSafetensors(path, nullptr, screen));
    std::set<std::string> missing = names;
    for (auto& [name, tensor] : tensors) {
      missing.erase(name);
      weights.emplace_back(name, std::move(tensor));
    }
    if (!missing.empty()) {
      return absl::DataLossError(absl::StrCat(index_path, ": tensor \"",
                                              Excerpt(*missing.begin()),
                                              "\" is not in ", path));
    }
  }
  return weights;
}

// FAILED_PRECONDITION naming the first field where the two configs differ.
absl::Status CheckSameConfig(const LlamaConfig& file_config,
                             const LlamaConfig& model_config) {
  const LlamaConfig f = file_config.WithDefaults();
  const LlamaConfig m = model_config.WithDefaults();
  absl::Status status;
  auto check = [&](const char* field, auto in_file, auto in_model) {
    if (!status.ok() || in_file == in_model) return;
    // json prints doubles exactly (shortest round trip), unlike StrCat.
    status = absl::FailedPreconditionError(absl::StrCat(
        "checkpoint config.", field, " is ", nlohmann::json(in_file).dump(),
        " but the model has ", nlohmann::json(in_model).dump()));
  };
  check("vocab_size", f.vocab_size, m.vocab_size);
  check("hidden_size", f.hidden_size, m.hidden_size);
  check("intermediate_size", f.intermediate_size, m.intermediate_size);
  check("num_hidden_layers", f.num_hidden_layers, m.num_hidden_layers);
  check("num_attention_heads", f.num_attention_heads, m.num_attention_heads);
  check("num_key_value_heads", f.num_key_value_heads, m.num_key_value_heads);
  check("rms_norm_eps", f.rms_norm_eps, m.rms_norm_eps);
  check("rope_theta", f.rope_theta, m.rope_theta);
  check("max_position_embeddings", f.max_position_embeddings,
        m.max_position_embeddings);
  check("tie_word_embeddings", f.tie_word_embeddings, m.tie_word_embeddings);
  return status;
}

}  // namespace

absl::StatusOr<std::string> PublishTarget(const std::string& dir,
                                          DirectoryKind kind) {
  std::error_code error;
  fs::path target = fs::absolute(dir, error).lexically_normal();
  if (error) {
    return absl::ErrnoToStatus(error.value(), absl::StrCat("resolve ", dir));
  }
  if (!target.has_filename()) target = target.parent_path();  // "a/b/"
  const std::string name = target.filename().string();
  if (name == "." || name == ".." || target == target.root_path()) {
    return absl::InvalidArgumentError(
        absl::StrCat("path ", dir, " names no directory"));
  }
  if (!fs::exists(target, error)) return target.string();
  const bool checkpoint = IsFile((target / kManifestFile).string());
  const bool replaceable =
      fs::is_directory(target, error) &&
      (fs::is_empty(target, error) ||
       (kind == DirectoryKind::kCheckpoint
            ? checkpoint
            : !checkpoint && IsFile((target / kChecksumFile).string())));
  if (!replaceable) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, " exists and is not ",
        kind == DirectoryKind::kCheckpoint
            ? absl::StrCat("a tally checkpoint (no ", kManifestFile, ")")
            : absl::StrCat("a weights export (no ", kChecksumFile,
                           ", or a checkpoint's ", kManifestFile, ")"),
        "; refusing to replace it"));
  }
  return target.string();
}

absl::StatusOr<NamedTensors> HfWeights(const CausalLm& model,
                                       torch::ScalarType dtype,
                                       bool trainable_only) {
  return CatchTorch("HF weights", [&]() -> absl::StatusOr<NamedTensors> {
    NamedTensors out;
    for (const Parameter& p : model.parameters()) {
      if (trainable_only && !p.trainable) continue;
      out.emplace_back(p.name, p.tensor.detach().to(dtype));
    }
    return model.ToHfTensors(std::move(out));
  });
}

absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& dir,
                                         const CausalLm& model,
                                         const Optimizer& optimizer,
                                         const CheckpointManifest& manifest,
                                         absl::string_view server_state) {
  TALLY_ASSIGN_OR_RETURN(const std::string target,
                         PublishTarget(dir, DirectoryKind::kCheckpoint));
  CheckpointManifest written = manifest;
  written.dtype = model.dtype();
  written.optimizer = optimizer.kind();
  written.optimizer_step_count = optimizer.step_count();
  written.tally_version = TALLY_VERSION;
  written.format_version = kCheckpointFormatVersion;

  TALLY_ASSIGN_OR_RETURN(
      NamedTensors weights,
      HfWeights(model, model.scalar_type(), manifest.trainable_only));
  TALLY_ASSIGN_OR_RETURN(SerializedSafetensors weights_file,
                         SerializeSafetensors(weights, {{"format", "pt"}}));
  TALLY_ASSIGN_OR_RETURN(SerializedSafetensors optimizer_file,
                         SerializeSafetensors(optimizer.StateTensors()));
  const std::string config_json =
      model.config().ToHfJson(DTypeName(MasterDType(model.dtype()))) + "\n";
  const std::string manifest_json = ManifestToJson(written);

  return PublishDirectory(target,
                          {{kConfigFile, {config_json}},
                           {kModelFile, weights_file.Pieces()},
                           {kOptimizerFile, optimizer_file.Pieces()},
                           {kServerStateFile, {server_state}},
                           {kManifestFile, {manifest_json}}},
                          kChecksumFile);
}

absl::StatusOr<CheckpointContents> ReadCheckpoint(
    const std::string& dir_arg, bool read_optimizer,
    const LlamaConfig* model_config) {
  const std::string dir = PublishedDir(dir_arg);
  std::error_code error;
  if (!fs::exists(dir, error)) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  if (!fs::is_directory(dir, error)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint path ", dir, " is not a directory"));
  }
  TALLY_ASSIGN_OR_RETURN(Checksums sums, Checksums::Read(dir));
  // Verifies `file` when present; a missing file is for the caller to judge.
  auto verify_if_present = [&](const char* file) -> absl::Status {
    return IsFile(PathIn(dir, file)) ? sums.Verify(file) : absl::OkStatus();
  };

  CheckpointContents contents;
  TALLY_RETURN_IF_ERROR(verify_if_present(kConfigFile));
  TALLY_ASSIGN_OR_RETURN(contents.config,
                         ReadHfConfig(PathIn(dir, kConfigFile)));
  if (model_config != nullptr) {
    TALLY_RETURN_IF_ERROR(CheckSameConfig(contents.config, *model_config));
  }

  const std::string manifest_path = PathIn(dir, kManifestFile);
  if (IsFile(manifest_path)) {
    TALLY_RETURN_IF_ERROR(sums.Verify(kManifestFile));
    TALLY_ASSIGN_OR_RETURN(contents.manifest, ReadManifest(manifest_path));
    if (contents.manifest->format_version >= 2 && !sums.present()) {
      return absl::DataLossError(absl::StrCat(
          PathIn(dir, kChecksumFile), " is missing: ", manifest_path,
          " is of format_version ", contents.manifest->format_version,
          ", which always has one"));
    }
  }

  // Every tensor is checked against the model config.json describes (or
  // the model loaded into) before memory for it is allocated.
  absl::StatusOr<ExpectedTensors> expected = ExpectedTensors::ForModel(
      model_config != nullptr ? *model_config : contents.config,
      contents.manifest ? contents.manifest->lora : LoraConfig());
  if (!expected.ok()) {
    return absl::Status(expected.status().code(),
                        absl::StrCat(PathIn(dir, kConfigFile), ": ",
                                     expected.status().message()));
  }
  const std::string model_path = PathIn(dir, kModelFile);
  const std::string index_path = PathIn(dir, kShardIndexFile);
  if (IsFile(model_path)) {
    TALLY_RETURN_IF_ERROR(sums.Verify(kModelFile));
    TALLY_ASSIGN_OR_RETURN(
        contents.weights,
        ReadSafetensors(model_path, nullptr, expected->WeightScreen()));
  } else if (IsFile(index_path)) {
    TALLY_ASSIGN_OR_RETURN(
        contents.weights, ReadShardedWeights(dir, index_path, sums, *expected));
  } else {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint directory ", dir,
                                                   " has neither ", kModelFile,
                                                   " nor ", kShardIndexFile));
  }

  const std::string optimizer_path = PathIn(dir, kOptimizerFile);
  if (read_optimizer && IsFile(optimizer_path)) {
    TALLY_RETURN_IF_ERROR(sums.Verify(kOptimizerFile));
    TALLY_ASSIGN_OR_RETURN(contents.optimizer_state,
                           ReadSafetensors(optimizer_path, nullptr,
                                           expected->OptimizerStateScreen()));
  }
  const std::string server_state_path = PathIn(dir, kServerStateFile);
  if (IsFile(server_state_path)) {
    TALLY_RETURN_IF_ERROR(sums.Verify(kServerStateFile));
    // Written by tally and checksummed; as large as the sequencer's
    // response cache.
    TALLY_ASSIGN_OR_RETURN(contents.server_state,
                           ReadFileUpTo(server_state_path, kMaxServerStateBytes,
                                        absl::StatusCode::kDataLoss));
  }
  return contents;
}

absl::StatusOr<CheckpointInfo> VerifyCheckpoint(const std::string& dir_arg) {
  const std::string dir = PublishedDir(dir_arg);
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  TALLY_ASSIGN_OR_RETURN(Checksums sums, Checksums::Read(dir));
  if (!sums.present() || !IsFile(PathIn(dir, kManifestFile))) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " is not a tally checkpoint with ", kChecksumFile,
                     " and ", kManifestFile));
  }
  for (const auto& [file, digest] : sums.digests()) {
    TALLY_RETURN_IF_ERROR(sums.Verify(file));
  }
  for (const char* required : {kConfigFile, kModelFile, kOptimizerFile}) {
    if (!sums.digests().count(required)) {
      return absl::DataLossError(absl::StrCat(PathIn(dir, kChecksumFile),
                                              " does not list ", required));
    }
  }
  CheckpointInfo info;
  TALLY_ASSIGN_OR_RETURN(info.config, ReadHfConfig(PathIn(dir, kConfigFile)));
  const std::string manifest_path = PathIn(dir, kManifestFile);
  TALLY_ASSIGN_OR_RETURN(info.manifest, ReadManifest(manifest_path));
  return info;
}

namespace {

using WeightCopies =
    std::vector<std::pair<torch::Tensor*, const torch::Tensor*>>;

bool TrainableOnly(const CheckpointContents& contents) {
  return contents.manifest && contents.manifest->trainable_only;
}

// Every check of LoadWeightsInto, and the copies it would make from
// `weights` (under the model's parameter names).
absl::StatusOr<WeightCopies> PlanWeightCopies(const LlamaConfig& config,
                                              const NamedTensors& weights,
                                              bool trainable_only,
                                              CausalLm& model) {
  TALLY_RETURN_IF_ERROR(CheckSameConfig(config, model.config()));

  std::map<std::string, const torch::Tensor*> unclaimed;
  for (const auto& [name, tensor] : weights) {
    if (!unclaimed.emplace(name, &tensor).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint weight ", name, " appears more than once"));
    }
  }
  WeightCopies copies;
  for (Parameter& p : model.parameters()) {
    const auto it = unclaimed.find(p.name);
    if (it == unclaimed.end() && trainable_only && !p.trainable) continue;
    if (it == unclaimed.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint weight ", p.name, " is missing"));
    }
    const torch::Tensor& source = *it->second;
    if (source.sizes() != p.tensor.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint weight ", p.name, " has shape ", c10::str(source.sizes()),
          ", expected ", c10::str(p.tensor.sizes())));
    }
    if (!torch::isFloatingType(source.scalar_type())) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint weight ", p.name, " has dtype ",
                       c10::toString(source.scalar_type()),
                       ", expected a floating point dtype"));
    }
    copies.emplace_back(&p.tensor, &source);
    unclaimed.erase(it);
  }
  for (const auto& [name, tensor] : unclaimed) {
    // HF ties by reusing the embedding whatever lm_head.weight holds.
    if (name == "lm_head.weight" && model.config().tie_word_embeddings)
      continue;
    if (absl::EndsWith(name, kRotaryBufferSuffix)) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint weight ", name, " is not a parameter of the model"));
  }
  return copies;
}

}  // namespace

absl::Status ValidateWeightsFor(const CheckpointContents& contents,
                                CausalLm& model) {
  TALLY_ASSIGN_OR_RETURN(NamedTensors weights,
                         model.FromHfTensors(contents.weights));
  return PlanWeightCopies(contents.config, weights, TrainableOnly(contents),
                          model)
      .status();
}

absl::Status LoadWeightsInto(const CheckpointContents& contents,
                             CausalLm& model) {
  // Everything is validated before the first copy, so a failure leaves the
  // model as it was.
  TALLY_ASSIGN_OR_RETURN(NamedTensors weights,
                         model.FromHfTensors(contents.weights));
  TALLY_ASSIGN_OR_RETURN(WeightCopies copies,
                         PlanWeightCopies(contents.config, weights,
                                          TrainableOnly(contents), model));
  return CatchTorch("load weights", [&] {
    torch::NoGradGuard no_grad;
    for (auto& [target, source] : copies) {
      TORCH_CHECK(InjectedFault(FaultPoint::kLoadCopy).ok(), "injected fault");
      target->copy_(*source);
    }
  });
}

}  // namespace tally
