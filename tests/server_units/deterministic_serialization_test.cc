// MakeSerializationDeterministic: equal messages are equal bytes through
// every serialization gRPC uses (a flat array for a response that fits its
// buffer, a stream otherwise), whatever order their map entries were
// inserted in — what lets a retry get the bytes its first caller got.
#include "server/deterministic_serialization.h"

#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "tally/v1/trainer.pb.h"

namespace tally {
namespace {

// What gRPC does with a response that fits its slice.
std::string IntoArray(const google::protobuf::MessageLite& message) {
  std::string bytes(message.ByteSizeLong(), '\0');
  message.SerializeWithCachedSizesToArray(
      reinterpret_cast<uint8_t*>(bytes.data()));
  return bytes;
}

// What it does with a larger one.
std::string ThroughStream(const google::protobuf::MessageLite& message) {
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  message.SerializeToZeroCopyStream(&stream);
  return bytes;
}

TEST(DeterministicSerializationTest, EqualMessagesAreEqualBytes) {
  MakeSerializationDeterministic();
  constexpr int kEntries = 32;
  for (int repeat = 0; repeat < 20; ++repeat) {
    v1::OptimStepResponse forward, backward;
    for (int i = 0; i < kEntries; ++i) {
      (*forward.mutable_metrics())[absl::StrCat("metric_", i)] = i;
      const int j = kEntries - 1 - i;
      (*backward.mutable_metrics())[absl::StrCat("metric_", j)] = j;
    }
    ASSERT_TRUE(
        google::protobuf::util::MessageDifferencer::Equals(forward, backward));
    EXPECT_EQ(IntoArray(forward), IntoArray(backward));
    EXPECT_EQ(ThroughStream(forward), ThroughStream(backward));
    EXPECT_EQ(forward.SerializeAsString(), backward.SerializeAsString());
    // A cached response parsed back (a retry's reply) is the same bytes too.
    v1::OptimStepResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(forward.SerializeAsString()));
    EXPECT_EQ(IntoArray(parsed), IntoArray(forward));
  }
}

}  // namespace
}  // namespace tally
