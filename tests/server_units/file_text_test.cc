// base/file_text: the whole-file reader on a thread with a small stack (an
// HTTP server's, where a /metrics scrape reads /proc), and across its chunks.
#include "base/file_text.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

class FileTextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::temp_directory_path() /
             absl::StrCat("file_text_test.", getpid()))
                .string();
  }
  void TearDown() override { std::filesystem::remove(path_); }

  // Writes `size` bytes that differ from one position to the next.
  std::string WriteFile(size_t size) {
    std::string text(size, '\0');
    for (size_t i = 0; i < size; ++i) text[i] = static_cast<char>('a' + i % 23);
    std::ofstream(path_, std::ios::binary) << text;
    return text;
  }

  std::string path_;
};

struct SmallStackRead {
  std::string path;
  absl::StatusOr<std::string> result;
};

// Runs ReadFileUpTo on a thread whose whole stack is `stack_bytes`.
absl::StatusOr<std::string> ReadOnSmallStack(const std::string& path,
                                             size_t stack_bytes) {
  SmallStackRead read{path, absl::UnknownError("the thread did not run")};
  pthread_attr_t attr;
  EXPECT_EQ(pthread_attr_init(&attr), 0);
  EXPECT_EQ(pthread_attr_setstacksize(&attr, stack_bytes), 0);
  pthread_t thread;
  const int created = pthread_create(
      &thread, &attr,
      [](void* arg) -> void* {
        auto* read = static_cast<SmallStackRead*>(arg);
        read->result = ReadFileUpTo(read->path, uint64_t{1} << 20);
        return nullptr;
      },
      &read);
  pthread_attr_destroy(&attr);
  EXPECT_EQ(created, 0);
  if (created == 0) EXPECT_EQ(pthread_join(thread, nullptr), 0);
  return read.result;
}

TEST_F(FileTextTest, ReadsOnAThreadWithA64KibStack) {
  const std::string text = WriteFile(200 * 1024);
  const absl::StatusOr<std::string> read = ReadOnSmallStack(path_, 64 * 1024);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, text);
}

TEST_F(FileTextTest, ReadsProcFilesOnAThreadWithA64KibStack) {
  const absl::StatusOr<std::string> read =
      ReadOnSmallStack("/proc/self/status", 64 * 1024);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(*read, HasSubstr("VmRSS:"));
}

TEST_F(FileTextTest, ReadsAcrossChunksUpToTheLimit) {
  // Three 64 KiB chunks and one byte more, with the limit exactly the size.
  const size_t size = 3 * 65536 + 1;
  const std::string text = WriteFile(size);
  const absl::StatusOr<std::string> read = ReadFileUpTo(path_, size);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, text);
  const absl::StatusOr<std::string> over = ReadFileUpTo(path_, size - 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr(path_));
}

TEST_F(FileTextTest, AMissingFileIsNotFoundAndNamed) {
  const absl::StatusOr<std::string> read = ReadFileUpTo(path_, 10);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(read.status().message(), HasSubstr(path_));
}

}  // namespace
}  // namespace tally
