#include "runtime/checkpoint.h"

#include <cerrno>
#include <exception>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

constexpr char kConfigFile[] = "config.json";
constexpr char kModelFile[] = "model.safetensors";
constexpr char kShardIndexFile[] = "model.safetensors.index.json";
constexpr char kOptimizerFile[] = "optimizer.safetensors";
constexpr char kManifestFile[] = "tally.json";
// A derived buffer that transformers < 4.31 saved with Llama weights.
constexpr char kRotaryBufferSuffix[] = ".rotary_emb.inv_freq";

std::string PathIn(const std::string& dir, const char* file) {
  return (fs::path(dir) / file).string();
}

bool IsFile(const std::string& path) {
  std::error_code ignored;
  return fs::is_regular_file(path, ignored);
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("read ", path));
  return text.str();
}

// The inverse of a `const char* Name(Enum)` function over `values`.
template <typename Enum>
std::optional<Enum> ParseEnum(const std::string& name,
                              std::initializer_list<Enum> values,
                              const char* (*name_of)(Enum)) {
  for (Enum value : values) {
    if (name == name_of(value)) return value;
  }
  return std::nullopt;
}

std::string ManifestToJson(const CheckpointManifest& m) {
  nlohmann::ordered_json j;
  j["format_version"] = m.format_version;
  j["tally_version"] = m.tally_version;
  j["step"] = m.step;
  j["dtype"] = DTypeName(m.dtype);
  j["optimizer"] = OptimizerName(m.optimizer);
  j["optimizer_step_count"] = m.optimizer_step_count;
  j["default_adam"] = {{"learning_rate", m.default_adam.learning_rate},
                       {"beta1", m.default_adam.beta1},
                       {"beta2", m.default_adam.beta2},
                       {"eps", m.default_adam.eps},
                       {"weight_decay", m.default_adam.weight_decay}};
  j["default_max_grad_norm"] = m.default_max_grad_norm;
  return j.dump(2) + "\n";
}

absl::StatusOr<CheckpointManifest> ManifestFromJson(const std::string& text,
                                                    const std::string& path) {
  const nlohmann::json j =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(absl::StrCat(path, " is not a JSON object"));
  }
  auto bad = [&](const std::string& field, const char* kind) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", field, " is missing or not ", kind));
  };
  // Finds `key` in `object` when `is_kind` holds for it.
  auto find = [](const nlohmann::json& object, const char* key,
                 bool (nlohmann::json::*is_kind)()
                     const noexcept) -> const nlohmann::json* {
    const auto it = object.find(key);
    return it != object.end() && ((*it).*is_kind)() ? &*it : nullptr;
  };
  auto read_int = [&](const char* key, auto& out) -> absl::Status {
    const nlohmann::json* v = find(j, key, &nlohmann::json::is_number_integer);
    if (v == nullptr) return bad(key, "an integer");
    out = v->get<std::remove_reference_t<decltype(out)>>();
    if (out < 0) return bad(key, "a non-negative integer");
    return absl::OkStatus();
  };
  auto read_double = [&](const nlohmann::json& object,
                         const std::string& field_prefix, const char* key,
                         double& out) -> absl::Status {
    const nlohmann::json* v = find(object, key, &nlohmann::json::is_number);
    if (v == nullptr) return bad(field_prefix + key, "a number");
    out = v->get<double>();
    return absl::OkStatus();
  };
  auto read_string = [&](const char* key, std::string& out) -> absl::Status {
    const nlohmann::json* v = find(j, key, &nlohmann::json::is_string);
    if (v == nullptr) return bad(key, "a string");
    out = v->get<std::string>();
    return absl::OkStatus();
  };

  CheckpointManifest m;
  TALLY_RETURN_IF_ERROR(read_int("format_version", m.format_version));
  if (m.format_version > kCheckpointFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": format_version ", m.format_version,
        " is newer than this tally reads (", kCheckpointFormatVersion, ")"));
  }
  TALLY_RETURN_IF_ERROR(read_string("tally_version", m.tally_version));
  TALLY_RETURN_IF_ERROR(read_int("step", m.step));
  TALLY_RETURN_IF_ERROR(
      read_int("optimizer_step_count", m.optimizer_step_count));

  std::string name;
  TALLY_RETURN_IF_ERROR(read_string("dtype", name));
  const std::optional<DType> dtype =
      ParseEnum(name, {DType::kFloat32, DType::kFloat64}, &DTypeName);
  if (!dtype) return bad("dtype", "\"float32\" or \"float64\"");
  m.dtype = *dtype;
  TALLY_RETURN_IF_ERROR(read_string("optimizer", name));
  const std::optional<OptimizerKind> optimizer = ParseEnum(
      name, {OptimizerKind::kAdamW, OptimizerKind::kSgd}, &OptimizerName);
  if (!optimizer) return bad("optimizer", "\"adamw\" or \"sgd\"");
  m.optimizer = *optimizer;

  const nlohmann::json* adam =
      find(j, "default_adam", &nlohmann::json::is_object);
  if (adam == nullptr) return bad("default_adam", "an object");
  AdamParams& a = m.default_adam;
  for (auto [key, field] :
       {std::pair<const char*, double*>{"learning_rate", &a.learning_rate},
        {"beta1", &a.beta1},
        {"beta2", &a.beta2},
        {"eps", &a.eps},
        {"weight_decay", &a.weight_decay}}) {
    TALLY_RETURN_IF_ERROR(read_double(*adam, "default_adam.", key, *field));
  }
  TALLY_RETURN_IF_ERROR(
      read_double(j, "", "default_max_grad_norm", m.default_max_grad_norm));
  return m;
}

absl::StatusOr<LlamaConfig> ReadConfig(const std::string& path) {
  if (!IsFile(path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is missing"));
  }
  TALLY_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
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

// HF's sharded layout: the index maps each tensor name to its shard file.
absl::StatusOr<NamedTensors> ReadShardedWeights(const std::string& dir,
                                                const std::string& index_path) {
  TALLY_ASSIGN_OR_RETURN(std::string text, ReadTextFile(index_path));
  const nlohmann::json index =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object() ||
      !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return absl::DataLossError(
        absl::StrCat(index_path, ": weight_map is missing or not an object"));
  }
  std::map<std::string, std::set<std::string>> names_by_shard;
  for (const auto& [name, shard] : index["weight_map"].items()) {
    const std::string file = shard.is_string() ? shard.get<std::string>() : "";
    // Shards live in `dir`; a path must not reach outside it.
    if (file.empty() || file == "." || file == ".." ||
        file.find('/') != std::string::npos) {
      return absl::DataLossError(absl::StrCat(index_path, ": weight_map \"",
                                              name, "\" names ", shard.dump(),
                                              ", not a file in the directory"));
    }
    names_by_shard[file].insert(name);
  }
  NamedTensors weights;
  for (const auto& [file, names] : names_by_shard) {
    const std::string path = (fs::path(dir) / file).string();
    if (!IsFile(path)) {
      return absl::DataLossError(absl::StrCat(index_path, " names shard ", path,
                                              ", which is missing"));
    }
    TALLY_ASSIGN_OR_RETURN(NamedTensors tensors, ReadSafetensors(path));
    std::set<std::string> missing = names;
    for (auto& [name, tensor] : tensors) {
      if (missing.erase(name) > 0)
        weights.emplace_back(name, std::move(tensor));
    }
    if (!missing.empty()) {
      return absl::DataLossError(absl::StrCat(
          index_path, ": tensor \"", *missing.begin(), "\" is not in ", path));
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

absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& dir,
                                         const LlamaModel& model,
                                         const Optimizer& optimizer,
                                         const CheckpointManifest& manifest) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) {
    return absl::ErrnoToStatus(error.value(),
                               absl::StrCat("create directory ", dir));
  }
  CheckpointManifest written = manifest;
  written.dtype = model.dtype();
  written.optimizer = optimizer.kind();
  written.optimizer_step_count = optimizer.step_count();
  written.tally_version = TALLY_VERSION;
  written.format_version = kCheckpointFormatVersion;

  const std::string config_json =
      model.config().ToHfJson(DTypeName(model.dtype())) + "\n";
  const std::string manifest_json = ManifestToJson(written);
  TALLY_ASSIGN_OR_RETURN(
      NamedTensors weights,
      CatchTorch("checkpoint weights", [&]() -> absl::StatusOr<NamedTensors> {
        NamedTensors out;
        for (const Parameter& p : model.parameters()) {
          out.emplace_back(p.name, p.tensor.detach().to(model.scalar_type()));
        }
        return ExpertWeightsToHf(std::move(out));
      }));

  const std::string config_path = PathIn(dir, kConfigFile);
  const std::string model_path = PathIn(dir, kModelFile);
  const std::string optimizer_path = PathIn(dir, kOptimizerFile);
  const std::string manifest_path = PathIn(dir, kManifestFile);
  TALLY_RETURN_IF_ERROR(WriteFileAtomically(config_path, {config_json}));
  TALLY_RETURN_IF_ERROR(
      WriteSafetensors(model_path, weights, {{"format", "pt"}}));
  TALLY_RETURN_IF_ERROR(
      WriteSafetensors(optimizer_path, optimizer.StateTensors()));
  // Last, so a directory with a manifest had its other files completed.
  TALLY_RETURN_IF_ERROR(WriteFileAtomically(manifest_path, {manifest_json}));

  uint64_t bytes = 0;
  for (const std::string* path :
       {&config_path, &model_path, &optimizer_path, &manifest_path}) {
    bytes += fs::file_size(*path, error);
    if (error) {
      return absl::ErrnoToStatus(error.value(), absl::StrCat("stat ", *path));
    }
  }
  return bytes;
}

absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& dir,
                                                  bool read_optimizer) {
  std::error_code error;
  if (!fs::exists(dir, error)) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  if (!fs::is_directory(dir, error)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint path ", dir, " is not a directory"));
  }
  CheckpointContents contents;
  TALLY_ASSIGN_OR_RETURN(contents.config, ReadConfig(PathIn(dir, kConfigFile)));

  const std::string manifest_path = PathIn(dir, kManifestFile);
  if (IsFile(manifest_path)) {
    TALLY_ASSIGN_OR_RETURN(std::string text, ReadTextFile(manifest_path));
    TALLY_ASSIGN_OR_RETURN(contents.manifest,
                           ManifestFromJson(text, manifest_path));
  }

  const std::string model_path = PathIn(dir, kModelFile);
  const std::string index_path = PathIn(dir, kShardIndexFile);
  if (IsFile(model_path)) {
    TALLY_ASSIGN_OR_RETURN(contents.weights, ReadSafetensors(model_path));
  } else if (IsFile(index_path)) {
    TALLY_ASSIGN_OR_RETURN(contents.weights,
                           ReadShardedWeights(dir, index_path));
  } else {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint directory ", dir,
                                                   " has neither ", kModelFile,
                                                   " nor ", kShardIndexFile));
  }

  // Mixtral's per-expert weights, stacked as the model holds them.
  TALLY_ASSIGN_OR_RETURN(contents.weights,
                         ExpertWeightsFromHf(std::move(contents.weights)));

  const std::string optimizer_path = PathIn(dir, kOptimizerFile);
  if (read_optimizer && IsFile(optimizer_path)) {
    TALLY_ASSIGN_OR_RETURN(contents.optimizer_state,
                           ReadSafetensors(optimizer_path));
  }
  return contents;
}

namespace {

using WeightCopies =
    std::vector<std::pair<torch::Tensor*, const torch::Tensor*>>;

// Every check of LoadWeightsInto, and the copies it would make.
absl::StatusOr<WeightCopies> PlanWeightCopies(
    const CheckpointContents& contents, LlamaModel& model) {
  TALLY_RETURN_IF_ERROR(CheckSameConfig(contents.config, model.config()));

  std::map<std::string, const torch::Tensor*> unclaimed;
  for (const auto& [name, tensor] : contents.weights) {
    if (!unclaimed.emplace(name, &tensor).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint weight ", name, " appears more than once"));
    }
  }
  WeightCopies copies;
  for (Parameter& p : model.parameters()) {
    const auto it = unclaimed.find(p.name);
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
                                LlamaModel& model) {
  return PlanWeightCopies(contents, model).status();
}

absl::Status LoadWeightsInto(const CheckpointContents& contents,
                             LlamaModel& model) {
  // Everything is validated before the first copy, so a failure leaves the
  // model as it was.
  TALLY_ASSIGN_OR_RETURN(WeightCopies copies,
                         PlanWeightCopies(contents, model));
  return CatchTorch("load weights", [&] {
    torch::NoGradGuard no_grad;
    for (auto& [target, source] : copies) target->copy_(*source);
  });
}

}  // namespace tally
