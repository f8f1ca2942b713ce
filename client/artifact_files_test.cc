#include "client/artifact_files.h"

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

std::string Sha256Hex(const std::string& data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(data.data(), data.size(), digest, &size, EVP_sha256(), nullptr);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), size));
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

class ArtifactFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           absl::StrCat(
               "artifact_files_test_", getpid(), "_",
               ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const auto& [name, data] : files_) {
      v1::ArtifactFile* file = manifest_.Add();
      file->set_path(name);
      file->set_size_bytes(data.size());
      file->set_sha256(Sha256Hex(data));
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes the artifact's bytes [from, to) as the server's chunks would.
  void Deliver(uint64_t from, uint64_t to) {
    uint64_t start = 0;
    for (const auto& [name, data] : files_) {
      const uint64_t end = start + data.size();
      for (uint64_t at = std::max(from, start); at < std::min(to, end); ++at) {
        v1::DownloadArtifactChunk chunk;
        chunk.set_path(name);
        chunk.set_file_offset(at - start);
        chunk.set_data(data.substr(at - start, 1));
        ASSERT_TRUE(WriteChunk(dir_.string(), chunk).ok());
      }
      start = end;
    }
  }

  fs::path dir_;
  const std::vector<std::pair<std::string, std::string>> files_ = {
      {"a.bin", "0123456789"}, {"empty", ""}, {"b.bin", "abcdef"}};
  ArtifactManifest manifest_;
};

TEST_F(ArtifactFilesTest, ResumesWhereAnyInterruptedDownloadStopped) {
  for (uint64_t stop = 0; stop <= 16; ++stop) {
    fs::remove_all(dir_);
    EXPECT_EQ(ResumeOffset(dir_.string(), manifest_).value(), 0);
    Deliver(0, stop);
    const uint64_t offset = ResumeOffset(dir_.string(), manifest_).value();
    EXPECT_EQ(offset, stop);
    Deliver(offset, 16);
    EXPECT_TRUE(VerifyFiles(dir_.string(), manifest_).ok()) << stop;
    EXPECT_EQ(ReadAll(dir_ / "a.bin"), "0123456789");
    EXPECT_EQ(ReadAll(dir_ / "b.bin"), "abcdef");
  }
}

TEST_F(ArtifactFilesTest, AnOverlongFileIsFetchedAgain) {
  Deliver(0, 16);
  std::ofstream(dir_ / "a.bin", std::ios::app) << "extra";
  EXPECT_EQ(ResumeOffset(dir_.string(), manifest_).value(), 0);
  EXPECT_FALSE(fs::exists(dir_ / "b.bin"));
  Deliver(0, 16);
  EXPECT_TRUE(VerifyFiles(dir_.string(), manifest_).ok());
}

TEST_F(ArtifactFilesTest, AMismatchIsDataLossAndTheFileIsDeleted) {
  Deliver(0, 16);
  std::ofstream(dir_ / "b.bin", std::ios::trunc) << "abcdeX";
  absl::Status status = VerifyFiles(dir_.string(), manifest_);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(status.message().find("b.bin"), absl::string_view::npos);
  EXPECT_FALSE(fs::exists(dir_ / "b.bin"));
  // A rerun resumes at b.bin and completes.
  EXPECT_EQ(ResumeOffset(dir_.string(), manifest_).value(), 10);
}

TEST_F(ArtifactFilesTest, PathsMustBePlainNames) {
  v1::DownloadArtifactChunk chunk;
  for (const char* bad : {"../x", "a/b", "..", "", "/etc/passwd"}) {
    chunk.set_path(bad);
    EXPECT_EQ(WriteChunk(dir_.string(), chunk).code(),
              absl::StatusCode::kDataLoss)
        << bad;
    ArtifactManifest manifest;
    manifest.Add()->set_path(bad);
    EXPECT_EQ(ResumeOffset(dir_.string(), manifest).status().code(),
              absl::StatusCode::kDataLoss)
        << bad;
  }
}

}  // namespace
}  // namespace tally
