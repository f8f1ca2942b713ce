#include "runtime/checkpoint/weights_export.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/file_text.h"
#include "base/json_reader.h"
#include "base/log.h"
#include "base/status.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/io/atomic_directory.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/causal_lm.h"
#include "runtime/model/lora.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

// Fields of a source config.json that describe how its weights are stored,
// which the export decides anew: never carried over ("dtype" is newer
// transformers' name for torch_dtype).
constexpr const char* kNotCarried[] = {"torch_dtype", "dtype",
                                       "quantization_config"};

// The most a file the export copies as it is (kExportCopiedFiles) may hold:
// a tokenizer.json of a 256k-token vocabulary is ~35 MB.
constexpr uint64_t kMaxCopiedFileBytes = uint64_t{128} << 20;

struct StoredDType {
  torch::ScalarType type;
  const char* name;  // config.json's torch_dtype
};

StoredDType StoredDTypeOf(ExportDType dtype, DType model_dtype) {
  switch (dtype) {
    case ExportDType::kModel:
      break;
    case ExportDType::kFloat32:
      return {torch::kFloat32, "float32"};
    case ExportDType::kFloat64:
      return {torch::kFloat64, "float64"};
    case ExportDType::kBFloat16:
      return {torch::kBFloat16, "bfloat16"};
    case ExportDType::kFloat16:
      return {torch::kFloat16, "float16"};
  }
  // A mixed-precision model exports what it computes with, bfloat16.
  return {ComputeScalarType(model_dtype), DTypeName(model_dtype)};
}

// The contents of the file at `path`, when it holds at most `max_bytes`
// (FAILED_PRECONDITION naming it when larger); nullopt when there is none.
absl::StatusOr<std::optional<std::string>> ReadIfPresent(const fs::path& path,
                                                         uint64_t max_bytes) {
  std::error_code error;
  if (!fs::is_regular_file(path, error)) return std::nullopt;
  return ReadFileUpTo(path.string(), max_bytes,
                      absl::StatusCode::kFailedPrecondition);
}

// What an export takes from its source directory.
struct SourceFiles {
  std::string config_path;
  std::optional<std::string> config;  // its config.json, when present
  // kExportCopiedFiles present there: name, contents.
  std::vector<std::pair<std::string, std::string>> copied;
};

absl::StatusOr<SourceFiles> ReadSourceFiles(const std::string& source_dir) {
  SourceFiles source;
  if (source_dir.empty()) return source;
  const fs::path dir = PublishedDir(source_dir);
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    Log(LogLevel::kWarning,
        absl::StrCat("the model's init_checkpoint ", source_dir,
                     " is gone: the weights export has no generation config "
                     "or tokenizer files of it, and none of its config.json "
                     "fields"));
    return source;
  }
  source.config_path = (dir / kConfigFile).string();
  TALLY_ASSIGN_OR_RETURN(
      source.config,
      ReadIfPresent(source.config_path, kConfigJsonLimits.max_bytes));
  for (const char* name : kExportCopiedFiles) {
    TALLY_ASSIGN_OR_RETURN(std::optional<std::string> text,
                           ReadIfPresent(dir / name, kMaxCopiedFileBytes));
    if (text) source.copied.emplace_back(name, *std::move(text));
  }
  return source;
}

// config.json: `tally_json` (LlamaConfig::ToHfJson) followed by the fields of
// the source's config.json that it lacks, in the source's order.
absl::StatusOr<std::string> MergedConfig(const std::string& tally_json,
                                         const SourceFiles& source) {
  absl::StatusOr<nlohmann::ordered_json> config =
      ParseJson<nlohmann::ordered_json>(tally_json, kConfigJsonLimits,
                                        "LlamaConfig::ToHfJson",
                                        absl::StatusCode::kInternal);
  if (!config.ok() || !config->is_object()) {
    return absl::InternalError("LlamaConfig::ToHfJson wrote no JSON object");
  }
  if (source.config) {
    // The source may have changed since the model was created from it.
    TALLY_ASSIGN_OR_RETURN(
        const nlohmann::ordered_json carried,
        ParseJson<nlohmann::ordered_json>(
            *source.config, kConfigJsonLimits, source.config_path,
            absl::StatusCode::kFailedPrecondition));
    if (!carried.is_object()) {
      return absl::FailedPreconditionError(
          absl::StrCat(source.config_path,
                       " is not a JSON object; a weights export of a model "
                       "created from it carries its fields over"));
    }
    for (const auto& [key, value] : carried.items()) {
      if (config->contains(key) ||
          std::find(std::begin(kNotCarried), std::end(kNotCarried), key) !=
              std::end(kNotCarried)) {
        continue;
      }
      (*config)[key] = value;
    }
  }
  return config->dump(2) + "\n";
}

// The weights laid out in files as HF lays them out.
struct ShardedWeights {
  std::vector<std::string> names;  // model.safetensors or model-0000i-of-...
  std::vector<SerializedSafetensors> files;
  std::string index_json;  // model.safetensors.index.json; empty for one file
};

absl::StatusOr<ShardedWeights> SerializeShards(const NamedTensors& weights,
                                               uint64_t max_shard_bytes) {
  std::vector<uint64_t> bytes;
  for (const auto& [name, t] : weights) {
    bytes.push_back(static_cast<uint64_t>(t.numel() * t.element_size()));
  }
  const std::vector<std::vector<size_t>> shards =
      SplitIntoShards(bytes, max_shard_bytes);
  ShardedWeights out;
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t total_size = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name =
        shards.size() == 1 ? std::string(kModelFile)
                           : absl::StrFormat("model-%05d-of-%05d.safetensors",
                                             s + 1, shards.size());
    NamedTensors tensors;
    for (size_t i : shards[s]) {
      tensors.push_back(weights[i]);
      weight_map[weights[i].first] = name;
      total_size += bytes[i];
    }
    TALLY_ASSIGN_OR_RETURN(SerializedSafetensors file,
                           SerializeSafetensors(tensors, {{"format", "pt"}}));
    out.names.push_back(name);
    out.files.push_back(std::move(file));
  }
  if (shards.size() > 1) {
    // As transformers writes it: json.dumps(index, indent=2, sort_keys=True).
    const nlohmann::json index = {{"metadata", {{"total_size", total_size}}},
                                  {"weight_map", weight_map}};
    out.index_json = index.dump(2) + "\n";
  }
  return out;
}

// The weights an HF directory of `model` holds, stored as `stored`: a LoRA
// model's merged into its base (computed in the model's dtype, then cast).
absl::StatusOr<NamedTensors> ExportedWeights(const CausalLm& model,
                                             torch::ScalarType stored) {
  if (!model.lora().enabled()) {
    return HfWeights(model, stored, /*trainable_only=*/false);
  }
  TALLY_ASSIGN_OR_RETURN(
      NamedTensors weights,
      HfWeights(model, model.scalar_type(), /*trainable_only=*/false));
  TALLY_ASSIGN_OR_RETURN(weights,
                         MergeLora(std::move(weights), model.lora().scaling()));
  return CatchTorch("export cast", [&]() -> absl::StatusOr<NamedTensors> {
    for (auto& [name, t] : weights) t = t.to(stored);
    return std::move(weights);
  });
}

// The files of a PEFT adapter directory of `model`'s LoRA factors.
absl::StatusOr<std::vector<DirectoryFile>> PeftFiles(
    const CausalLm& model, torch::ScalarType stored,
    const std::string& source_dir, std::string& config,
    SerializedSafetensors& weights_file) {
  NamedTensors factors;
  for (const Parameter& p : model.parameters()) {
    if (IsLoraParameter(p.name)) {
      factors.emplace_back(absl::StrCat(kPeftKeyPrefix, p.name),
                           p.tensor.detach().to(stored));
    }
  }
  TALLY_ASSIGN_OR_RETURN(weights_file,
                         SerializeSafetensors(factors, {{"format", "pt"}}));
  config = PeftAdapterConfig(model.lora(), source_dir);
  return std::vector<DirectoryFile>{{kPeftConfigFile, {config}},
                                    {kPeftWeightsFile, weights_file.Pieces()}};
}

}  // namespace

std::vector<std::vector<size_t>> SplitIntoShards(
    const std::vector<uint64_t>& tensor_bytes, uint64_t max_shard_bytes) {
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_bytes = 0;
  for (size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (tensor_bytes[i] > max_shard_bytes) {
      shards.push_back({i});
      continue;
    }
    if (current_bytes + tensor_bytes[i] > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += tensor_bytes[i];
  }
  if (!current.empty()) shards.push_back(std::move(current));
  return shards;
}

absl::StatusOr<ExportResult> WriteWeightsExport(const std::string& dir,
                                                const CausalLm& model,
                                                const ExportOptions& options,
                                                const std::string& source_dir) {
  if (options.max_shard_bytes == 0) {
    return absl::InvalidArgumentError("max_shard_bytes must be positive");
  }
  if (options.merge && !model.lora().enabled()) {
    return absl::InvalidArgumentError(
        "merge: the model has no LoRA adapter to merge");
  }
  TALLY_ASSIGN_OR_RETURN(const std::string target,
                         PublishTarget(dir, DirectoryKind::kWeightsExport));
  const StoredDType stored = StoredDTypeOf(options.dtype, model.dtype());
  TALLY_ASSIGN_OR_RETURN(const SourceFiles source, ReadSourceFiles(source_dir));
  std::vector<DirectoryFile> files;
  // Views of these stay in `files` until the directory is published.
  std::string config;
  SerializedSafetensors adapter_file;
  ShardedWeights shards;
  if (model.lora().enabled() && !options.merge) {
    TALLY_ASSIGN_OR_RETURN(
        files, PeftFiles(model, stored.type, source_dir, config, adapter_file));
  } else {
    TALLY_ASSIGN_OR_RETURN(const NamedTensors weights,
                           ExportedWeights(model, stored.type));
    TALLY_ASSIGN_OR_RETURN(shards,
                           SerializeShards(weights, options.max_shard_bytes));
    LlamaConfig written = model.config();
    // A merged head of a tied model is a weight of its own.
    written.tie_word_embeddings &=
        std::none_of(weights.begin(), weights.end(),
                     [](const auto& w) { return w.first == "lm_head.weight"; });
    TALLY_ASSIGN_OR_RETURN(config,
                           MergedConfig(written.ToHfJson(stored.name), source));
    files.push_back({kConfigFile, {config}});
    for (size_t s = 0; s < shards.files.size(); ++s) {
      files.push_back({shards.names[s], shards.files[s].Pieces()});
    }
    if (!shards.index_json.empty()) {
      files.push_back({kShardIndexFile, {shards.index_json}});
    }
  }
  for (const auto& [name, text] : source.copied) {
    files.push_back({name, {text}});
  }
  ExportResult result;
  result.path = target;
  TALLY_ASSIGN_OR_RETURN(result.bytes_written,
                         PublishDirectory(target, files, kChecksumFile));
  for (const DirectoryFile& file : files) result.files.push_back(file.name);
  result.files.push_back(kChecksumFile);
  std::sort(result.files.begin(), result.files.end());
  return result;
}

}  // namespace tally
