// Weights export: a model's weights as an HF model directory for inference,
// as transformers' save_pretrained writes one, so that `from_pretrained` and
// vLLM load it as the model's family (Tinker's save_weights_for_sampler).
// Unlike a checkpoint (checkpoint.h) it holds no optimizer state, step or
// server state, and may store a narrower dtype than the model trains in.
//
//   <dir>/config.json          LlamaConfig::ToHfJson, plus the fields of the
//                              source directory's config.json tally does not
//                              write itself (bos_token_id, eos_token_id, ...)
//   <dir>/model.safetensors    every weight under its HF name, or past
//                              max_shard_bytes HF's sharded layout:
//   <dir>/model-00001-of-0000N.safetensors ...
//   <dir>/model.safetensors.index.json     {"metadata": {"total_size": bytes},
//                                           "weight_map": {name: file}}
//   <dir>/generation_config.json, tokenizer files (kExportCopiedFiles):
//                              copied from the source directory, when there
//   <dir>/checksums.sha256     `sha256sum` lines for every file above
//
// The directory is published atomically like a checkpoint
// (atomic_directory.h) and replaces only an earlier export (PublishTarget).
// This header is torch-free, so the server's request parsing (built without
// LibTorch for its fuzzer) names the options.
//
//   tally::ExportOptions options;
//   options.dtype = tally::ExportDType::kBFloat16;
//   TALLY_ASSIGN_OR_RETURN(
//       tally::ExportResult exported,
//       tally::WriteWeightsExport(dir, model, options, spec.init_checkpoint));
#ifndef TALLY_RUNTIME_CHECKPOINT_WEIGHTS_EXPORT_H_
#define TALLY_RUNTIME_CHECKPOINT_WEIGHTS_EXPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tally {

class CausalLm;  // causal_lm.h

// The dtype an export stores. kBFloat16 and kFloat16 are storage dtypes only
// (models train in float32 or float64); casts round to nearest even.
enum class ExportDType { kModel, kFloat32, kFloat64, kBFloat16, kFloat16 };

// HF's default max_shard_size, "5GB" (decimal).
inline constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000;

struct ExportOptions {
  ExportDType dtype = ExportDType::kModel;
  // The largest shard in tensor bytes (> 0); a single tensor larger than this
  // gets a shard of its own, as in HF.
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;
  // A LoRA model: false writes the adapter in PEFT's format (lora.h), true
  // the base with the adapter merged in (W + alpha / rank * B A) as a full
  // HF directory. Models without an adapter refuse true.
  bool merge = false;
};

struct ExportResult {
  std::string path;  // absolute, normalized
  uint64_t bytes_written = 0;
  std::vector<std::string> files;  // names inside path, sorted
};

// The files an export copies from its source directory when present: the
// generation config and every tokenizer file transformers writes.
inline constexpr const char* kExportCopiedFiles[] = {"generation_config.json",
                                                     "tokenizer.json",
                                                     "tokenizer_config.json",
                                                     "special_tokens_map.json",
                                                     "tokenizer.model",
                                                     "vocab.json",
                                                     "merges.txt",
                                                     "added_tokens.json",
                                                     "chat_template.jinja"};

// HF's split of tensors of `tensor_bytes` (in order) into shards of at most
// `max_shard_bytes` (huggingface_hub's split_torch_state_dict_into_shards):
// tensors fill the current shard in order until the next would overflow it;
// a tensor larger than the limit alone gets its own shard, placed before the
// shard being filled. Returns each shard's tensor indices, in order.
std::vector<std::vector<size_t>> SplitIntoShards(
    const std::vector<uint64_t>& tensor_bytes, uint64_t max_shard_bytes);

// Writes the weights of `model` (a whole model, all stages, unsharded) to
// `dir` as described above, in options.dtype, replacing an earlier export
// there atomically. `source_dir` (the model's init_checkpoint; empty: none)
// gives the copied files and the config fields carried over, every field
// tally writes taking precedence; absent files are skipped, and so is a
// source directory that no longer exists (with a warning). On failure `dir`
// is as it was: INVALID_ARGUMENT for max_shard_bytes 0 or a path naming no
// directory, FAILED_PRECONDITION for something other than an export at `dir`,
// a source config.json that is not a JSON object or is beyond
// kConfigJsonLimits (base/json_reader.h), or a copied file over 128 MiB.
absl::StatusOr<ExportResult> WriteWeightsExport(const std::string& dir,
                                                const CausalLm& model,
                                                const ExportOptions& options,
                                                const std::string& source_dir);

}  // namespace tally

#endif  // TALLY_RUNTIME_CHECKPOINT_WEIGHTS_EXPORT_H_
