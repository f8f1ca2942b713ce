#include "client/text_batcher.h"

#include <cstdint>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/file_text.h"

namespace tally {

std::string DefaultCorpusPath() { return TALLY_DEFAULT_CORPUS; }

absl::StatusOr<TextBatcher> TextBatcher::FromText(
    std::string text, const TextBatcherOptions& options) {
  auto invalid = [](const char* field, const auto&... why) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.", field, " ", why...));
  };
  if (options.calls_per_step < 1) {
    return invalid("calls_per_step", "must be >= 1, got ",
                   options.calls_per_step);
  }
  if (options.max_samples_per_call < 1) {
    return invalid("max_samples_per_call", "must be >= 1, got ",
                   options.max_samples_per_call);
  }
  // A sample needs BOS plus one byte to predict anything.
  if (options.min_len < 2) {
    return invalid("min_len", "must be >= 2, got ", options.min_len);
  }
  if (options.max_len < options.min_len) {
    return invalid("max_len", "(", options.max_len,
                   ") must be >= options.min_len (", options.min_len, ")");
  }
  if (text.size() < static_cast<size_t>(options.max_len)) {
    return invalid("max_len", "(", options.max_len,
                   ") exceeds the text length (", text.size(), " bytes)");
  }
  if (!(options.max_prompt_fraction >= 0.0 &&
        options.max_prompt_fraction < 1.0)) {
    return invalid("max_prompt_fraction", "must be in [0, 1), got ",
                   options.max_prompt_fraction);
  }
  if (!(options.zero_weight_probability >= 0.0 &&
        options.zero_weight_probability < 1.0)) {
    return invalid("zero_weight_probability", "must be in [0, 1), got ",
                   options.zero_weight_probability);
  }
  return TextBatcher(std::move(text), options);
}

absl::StatusOr<TextBatcher> TextBatcher::FromFile(
    const std::string& path, const TextBatcherOptions& options) {
  const absl::StatusOr<std::string> contents =
      ReadFileUpTo(path, std::numeric_limits<uint64_t>::max(),
                   absl::StatusCode::kFailedPrecondition);
  if (!contents.ok()) {
    const absl::StatusCode code =
        contents.status().code() == absl::StatusCode::kNotFound
            ? absl::StatusCode::kNotFound
            : absl::StatusCode::kFailedPrecondition;
    return absl::Status(code, absl::StrCat("cannot read text file ", path, ": ",
                                           contents.status().message()));
  }
  absl::StatusOr<TextBatcher> batcher = FromText(*contents, options);
  if (!batcher.ok()) {
    return absl::Status(batcher.status().code(),
                        absl::StrCat(path, ": ", batcher.status().message()));
  }
  return batcher;
}

TextBatcher::TextBatcher(std::string text, const TextBatcherOptions& options)
    : text_(std::move(text)), options_(options), rng_(options.seed) {}

int64_t TextBatcher::UniformInt(int64_t lo, int64_t hi) {
  // Modulo keeps the sequence fixed across standard libraries (the
  // std::uniform_*_distribution algorithms are not specified); its bias is
  // ~2^-40 for these ranges.
  return lo + static_cast<int64_t>(rng_() % static_cast<uint64_t>(hi - lo + 1));
}

double TextBatcher::UniformUnit() {
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

v1::Sample TextBatcher::DrawSample() {
  const int64_t length = UniformInt(options_.min_len, options_.max_len);
  const int64_t offset =
      UniformInt(0, static_cast<int64_t>(text_.size()) - length);
  const int64_t prompt = UniformInt(
      0, static_cast<int64_t>(length * options_.max_prompt_fraction));
  const bool weighted = options_.zero_weight_probability > 0.0;

  v1::Sample sample;
  sample.mutable_input_tokens()->Reserve(length);
  sample.mutable_target_tokens()->Reserve(length);
  for (int64_t i = 0; i < length; ++i) {
    const auto byte_at = [&](int64_t pos) {
      return static_cast<int32_t>(static_cast<unsigned char>(text_[pos]));
    };
    sample.add_input_tokens(i == 0 ? byte_vocab::kBos
                                   : byte_at(offset + i - 1));
    const bool masked = i < prompt;
    sample.add_target_tokens(masked ? kIgnoredTarget : byte_at(offset + i));
    if (weighted) {
      const bool zeroed =
          !masked && UniformUnit() < options_.zero_weight_probability;
      sample.add_weights(zeroed ? 0.0f : 1.0f);
    }
  }
  return sample;
}

std::vector<std::vector<v1::Sample>> TextBatcher::NextStep() {
  const int64_t rotation = UniformInt(0, options_.max_samples_per_call - 1);
  std::vector<std::vector<v1::Sample>> calls(options_.calls_per_step);
  for (int c = 0; c < options_.calls_per_step; ++c) {
    const int64_t count = 1 + (c + rotation) % options_.max_samples_per_call;
    calls[c].reserve(count);
    for (int64_t s = 0; s < count; ++s) calls[c].push_back(DrawSample());
  }
  return calls;
}

}  // namespace tally
