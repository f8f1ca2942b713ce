// TextBatcher: turns plain text into next-byte-prediction samples for the
// server's embedded byte-level demo model, one training step at a time.
//
// Each step is several ForwardBackward calls whose sample counts and lengths
// are deliberately uneven (the case token-weighted accumulation exists for),
// with a random prefix of every sample masked as an SFT-style "prompt".
//
//   tally::TextBatcherOptions options;
//   options.max_len = 128;  // <= the model's max_position_embeddings
//   TALLY_ASSIGN_OR_RETURN(
//       tally::TextBatcher batcher,
//       tally::TextBatcher::FromFile(tally::DefaultCorpusPath(), options));
//   for (std::vector<tally::v1::Sample>& call : batcher.NextStep()) {
//     tally::v1::ForwardBackwardRequest request;
//     request.set_model_id("demo");
//     for (auto& sample : call) *request.add_samples() = std::move(sample);
//     ...
//   }
#ifndef TALLY_CLIENT_TEXT_BATCHER_H_
#define TALLY_CLIENT_TEXT_BATCHER_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

// The byte-level vocabulary of the server's embedded default model. The
// client does not link the runtime, so the convention is restated here.
namespace byte_vocab {
inline constexpr int32_t kNumByteTokens = 256;  // ids 0..255 are raw bytes
inline constexpr int32_t kBos = 256;
inline constexpr int32_t kEos = 257;
inline constexpr int32_t kPad = 258;
inline constexpr int32_t kVocabSize = 260;  // one spare id after PAD
}  // namespace byte_vocab

// The public-domain text bundled under data/ (an absolute path fixed at build
// time).
std::string DefaultCorpusPath();

struct TextBatcherOptions {
  int calls_per_step = 4;
  // Call c of a step gets 1 + (c + r) % max_samples_per_call samples for a
  // random r, so neighbouring calls never carry the same count.
  int max_samples_per_call = 4;
  // Tokens per sample, drawn uniformly from [min_len, max_len].
  int min_len = 16;
  int max_len = 128;
  // A sample's masked "prompt" prefix covers up to this fraction of it.
  double max_prompt_fraction = 0.5;
  // Chance that an unmasked position gets weight 0. 0 sends no weights.
  double zero_weight_probability = 0.0;
  uint64_t seed = 0;
};

class TextBatcher {
 public:
  // The target id of a position that takes no loss.
  static constexpr int32_t kIgnoredTarget = -100;

  // INVALID_ARGUMENT naming the option for inconsistent options or a text
  // shorter than max_len bytes.
  static absl::StatusOr<TextBatcher> FromText(
      std::string text, const TextBatcherOptions& options);
  // As FromText, plus the file errors (NOT_FOUND, ...) naming the path.
  static absl::StatusOr<TextBatcher> FromFile(
      const std::string& path, const TextBatcherOptions& options);

  // The samples of every ForwardBackward call of the next step; a sample of
  // length L drawn at text offset o has input_tokens = [BOS, text[o..o+L-1)]
  // and target_tokens = text[o..o+L), its first targets masked.
  // Deterministic for a given seed.
  std::vector<std::vector<v1::Sample>> NextStep();

  const std::string& text() const { return text_; }

 private:
  TextBatcher(std::string text, const TextBatcherOptions& options);

  // Uniform in [lo, hi].
  int64_t UniformInt(int64_t lo, int64_t hi);
  // Uniform in [0, 1).
  double UniformUnit();
  v1::Sample DrawSample();

  std::string text_;
  TextBatcherOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace tally

#endif  // TALLY_CLIENT_TEXT_BATCHER_H_
