#include "client/text_batcher.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

// A text with enough variety that a 20-byte window pins down its offset.
std::string VariedText(size_t size) {
  std::string text;
  uint32_t state = 12345;
  while (text.size() < size) {
    state = state * 1103515245u + 12345u;
    text.push_back(static_cast<char>(32 + (state >> 16) % 95));
  }
  return text;
}

// The bytes a sample covers: its inputs after BOS plus its last target
// (never masked: masking covers a strict prefix).
std::string CoveredBytes(const v1::Sample& sample) {
  std::string bytes;
  for (int i = 1; i < sample.input_tokens_size(); ++i) {
    bytes.push_back(static_cast<char>(sample.input_tokens(i)));
  }
  bytes.push_back(
      static_cast<char>(sample.target_tokens(sample.target_tokens_size() - 1)));
  return bytes;
}

std::vector<v1::Sample> Flatten(
    const std::vector<std::vector<v1::Sample>>& calls) {
  std::vector<v1::Sample> samples;
  for (const auto& call : calls) {
    samples.insert(samples.end(), call.begin(), call.end());
  }
  return samples;
}

TEST(TextBatcherTest, InputsAreBosThenTextAndTargetsAreTheNextBytes) {
  const std::string text = VariedText(5000);
  TextBatcherOptions options;
  options.min_len = 20;
  options.max_len = 64;
  auto batcher = TextBatcher::FromText(text, options);
  ASSERT_TRUE(batcher.ok()) << batcher.status();

  for (int step = 0; step < 5; ++step) {
    for (const v1::Sample& sample : Flatten(batcher->NextStep())) {
      const int length = sample.input_tokens_size();
      ASSERT_EQ(sample.target_tokens_size(), length);
      EXPECT_EQ(sample.input_tokens(0), byte_vocab::kBos);
      // The window is a real stretch of the text...
      const std::string covered = CoveredBytes(sample);
      const size_t offset = text.find(covered);
      ASSERT_NE(offset, std::string::npos);
      // ...and every unmasked target is the byte right after its input
      // prefix: position i predicts text[offset + i].
      for (int i = 0; i < length; ++i) {
        if (sample.target_tokens(i) == TextBatcher::kIgnoredTarget) continue;
        EXPECT_EQ(sample.target_tokens(i),
                  static_cast<unsigned char>(text[offset + i]))
            << "position " << i;
        if (i + 1 < length) {
          EXPECT_EQ(sample.target_tokens(i), sample.input_tokens(i + 1));
        }
      }
    }
  }
}

TEST(TextBatcherTest, MaskedTargetsFormABoundedPrefix) {
  TextBatcherOptions options;
  options.min_len = 10;
  options.max_len = 40;
  options.max_prompt_fraction = 0.5;
  auto batcher = TextBatcher::FromText(VariedText(2000), options);
  ASSERT_TRUE(batcher.ok()) << batcher.status();

  int samples_with_prompt = 0;
  int samples = 0;
  for (int step = 0; step < 10; ++step) {
    for (const v1::Sample& sample : Flatten(batcher->NextStep())) {
      ++samples;
      const auto& targets = sample.target_tokens();
      const int masked = static_cast<int>(
          std::find_if(targets.begin(), targets.end(),
                       [](int t) { return t != TextBatcher::kIgnoredTarget; }) -
          targets.begin());
      EXPECT_LE(masked, targets.size() / 2);
      EXPECT_EQ(std::count(targets.begin() + masked, targets.end(),
                           TextBatcher::kIgnoredTarget),
                0);
      if (masked > 0) ++samples_with_prompt;
    }
  }
  EXPECT_GT(samples_with_prompt, samples / 2);
}

TEST(TextBatcherTest, CountsAndLengthsAreUnevenAndBounded) {
  TextBatcherOptions options;
  options.calls_per_step = 4;
  options.max_samples_per_call = 3;
  options.min_len = 8;
  options.max_len = 50;
  auto batcher = TextBatcher::FromText(VariedText(1000), options);
  ASSERT_TRUE(batcher.ok()) << batcher.status();

  std::set<int> lengths;
  for (int step = 0; step < 10; ++step) {
    const auto calls = batcher->NextStep();
    ASSERT_EQ(calls.size(), 4u);
    for (size_t c = 0; c < calls.size(); ++c) {
      EXPECT_GE(calls[c].size(), 1u);
      EXPECT_LE(calls[c].size(), 3u);
      if (c > 0) EXPECT_NE(calls[c].size(), calls[c - 1].size());
      for (const v1::Sample& sample : calls[c]) {
        EXPECT_GE(sample.input_tokens_size(), 8);
        EXPECT_LE(sample.input_tokens_size(), 50);
        lengths.insert(sample.input_tokens_size());
      }
    }
  }
  EXPECT_GT(lengths.size(), 5u);
}

TEST(TextBatcherTest, EveryTokenIsInTheByteVocabulary) {
  // Bytes >= 128 must map to 128..255, never to negative ids.
  std::string text = VariedText(400);
  for (size_t i = 0; i < text.size(); i += 3) {
    text[i] = static_cast<char>(0x80 + i % 128);
  }
  TextBatcherOptions options;
  options.max_len = 100;
  auto batcher = TextBatcher::FromText(text, options);
  ASSERT_TRUE(batcher.ok()) << batcher.status();
  int high_bytes = 0;
  for (const v1::Sample& sample : Flatten(batcher->NextStep())) {
    for (int token : sample.input_tokens()) {
      EXPECT_GE(token, 0);
      EXPECT_LT(token, byte_vocab::kVocabSize);
      if (token >= 128 && token < byte_vocab::kNumByteTokens) ++high_bytes;
    }
    for (int token : sample.target_tokens()) {
      if (token == TextBatcher::kIgnoredTarget) continue;
      EXPECT_GE(token, 0);
      EXPECT_LT(token, byte_vocab::kNumByteTokens);
    }
  }
  EXPECT_GT(high_bytes, 0);
}

TEST(TextBatcherTest, SameSeedSameSamplesOtherSeedOtherSamples) {
  const std::string text = VariedText(3000);
  TextBatcherOptions options;
  options.seed = 7;
  auto serialize = [&](uint64_t seed) {
    TextBatcherOptions seeded = options;
    seeded.seed = seed;
    auto batcher = TextBatcher::FromText(text, seeded);
    EXPECT_TRUE(batcher.ok()) << batcher.status();
    std::string bytes;
    for (int step = 0; step < 3; ++step) {
      for (const auto& sample : Flatten(batcher->NextStep())) {
        bytes += sample.SerializeAsString();
      }
    }
    return bytes;
  };
  EXPECT_EQ(serialize(7), serialize(7));
  EXPECT_NE(serialize(7), serialize(8));
}

TEST(TextBatcherTest, ZeroWeightsOnlyWhenAskedAndNeverOnMaskedPositions) {
  const std::string text = VariedText(3000);
  TextBatcherOptions options;
  auto unweighted = TextBatcher::FromText(text, options);
  ASSERT_TRUE(unweighted.ok()) << unweighted.status();
  for (const auto& sample : Flatten(unweighted->NextStep())) {
    EXPECT_EQ(sample.weights_size(), 0);
  }

  options.zero_weight_probability = 0.25;
  auto weighted = TextBatcher::FromText(text, options);
  ASSERT_TRUE(weighted.ok()) << weighted.status();
  int zeros = 0;
  int unmasked = 0;
  for (int step = 0; step < 5; ++step) {
    for (const auto& sample : Flatten(weighted->NextStep())) {
      ASSERT_EQ(sample.weights_size(), sample.target_tokens_size());
      for (int i = 0; i < sample.weights_size(); ++i) {
        const float w = sample.weights(i);
        EXPECT_TRUE(w == 0.0f || w == 1.0f) << w;
        if (sample.target_tokens(i) == TextBatcher::kIgnoredTarget) {
          EXPECT_EQ(w, 1.0f);
          continue;
        }
        ++unmasked;
        if (w == 0.0f) ++zeros;
      }
    }
  }
  // Binomial(unmasked, 0.25): far inside +-5 standard deviations.
  const double expected = 0.25 * unmasked;
  const double sigma = std::sqrt(unmasked * 0.25 * 0.75);
  EXPECT_NEAR(zeros, expected, 5 * sigma);
}

TEST(TextBatcherTest, RejectsBadOptionsNamingTheField) {
  TextBatcherOptions options;
  options.max_len = 200;
  auto too_short = TextBatcher::FromText(std::string(100, 'a'), options);
  EXPECT_EQ(too_short.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_short.status().message()),
              HasSubstr("options.max_len"));

  options = TextBatcherOptions();
  options.min_len = 1;
  auto bad_min = TextBatcher::FromText(VariedText(500), options);
  EXPECT_THAT(std::string(bad_min.status().message()),
              HasSubstr("options.min_len"));

  options = TextBatcherOptions();
  options.calls_per_step = 0;
  auto bad_calls = TextBatcher::FromText(VariedText(500), options);
  EXPECT_THAT(std::string(bad_calls.status().message()),
              HasSubstr("options.calls_per_step"));

  auto missing = TextBatcher::FromFile("/nonexistent/tally/corpus.txt",
                                       TextBatcherOptions());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("/nonexistent/tally/corpus.txt"));
}

TEST(TextBatcherTest, BundledCorpusIsLargePlainText) {
  std::ifstream file(DefaultCorpusPath(), std::ios::binary);
  ASSERT_TRUE(file) << DefaultCorpusPath();
  std::stringstream contents;
  contents << file.rdbuf();
  const std::string text = contents.str();
  EXPECT_GE(text.size(), 30u * 1024);
  EXPECT_LE(text.size(), 1024u * 1024);
  // Plain ASCII: printable characters and line breaks only.
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    ASSERT_TRUE(c == '\n' || (c >= 32 && c < 127)) << "byte " << i;
  }
  auto batcher =
      TextBatcher::FromFile(DefaultCorpusPath(), TextBatcherOptions());
  ASSERT_TRUE(batcher.ok()) << batcher.status();
  EXPECT_EQ(batcher->text(), text);
}

}  // namespace
}  // namespace tally
