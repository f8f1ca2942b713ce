#include "server/artifacts.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace tally {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string HexDigestOf(const std::string& data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(data.data(), data.size(), digest, &size, EVP_sha256(), nullptr);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), size));
}

void WriteTestFile(const fs::path& path, const std::string& data) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}

// A checkpoint-shaped directory: `files` and their checksums.sha256 (and
// tally.json for a state checkpoint).
void WriteArtifact(const fs::path& dir,
                   std::vector<std::pair<std::string, std::string>> files,
                   bool state) {
  if (state) files.emplace_back("tally.json", "{\"step\": 3}");
  std::string list;
  for (const auto& [name, data] : files) {
    WriteTestFile(dir / name, data);
    absl::StrAppend(&list, HexDigestOf(data), "  ", name, "\n");
  }
  WriteTestFile(dir / "checksums.sha256", list);
}

class ArtifactsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ =
        fs::temp_directory_path() /
        absl::StrCat(
            "artifacts_test_", getpid(), "_",
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "alice");
    fs::create_directories(root_ / "bob");
  }
  void TearDown() override { fs::remove_all(root_); }

  fs::path root_;
  ArtifactStore Store() const { return ArtifactStore(root_.string()); }
};

TEST_F(ArtifactsTest, ResolvesAHandleInsideTheTenantsRoot) {
  WriteArtifact(root_ / "alice/run/s1", {{"model.safetensors", "abc"}}, true);
  absl::StatusOr<std::string> dir = Store().Resolve("alice", "tally://run/s1");
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(fs::path(*dir), fs::canonical(root_ / "alice/run/s1"));
  EXPECT_EQ(Store().HandleOf("alice", *dir).value(), "tally://run/s1");
}

TEST_F(ArtifactsTest, AnotherTenantsHandleIsNotFound) {
  WriteArtifact(root_ / "alice/run/s1", {{"model.safetensors", "abc"}}, true);
  EXPECT_EQ(Store().Resolve("bob", "tally://run/s1").status().code(),
            absl::StatusCode::kNotFound);
  // A tenant without a directory yet, likewise.
  EXPECT_EQ(Store().Resolve("carol", "tally://run/s1").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ArtifactsTest, EscapesAreInvalidArguments) {
  WriteArtifact(root_ / "alice/run/s1", {{"model.safetensors", "abc"}}, true);
  fs::create_symlink(root_ / "alice", root_ / "bob/link");
  for (const std::string& handle : std::vector<std::string>{
           "run/s1", "tally://", "tally:///etc", "tally://../alice/run/s1",
           "tally://run/../../alice/run/s1", "tally://link/run/s1",
           std::string("tally://run\0x", 13)}) {
    absl::Status status = Store().Resolve("bob", handle).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << handle;
    EXPECT_THAT(status.message(), HasSubstr("handle")) << handle;
    EXPECT_THAT(status.message(), ::testing::Not(HasSubstr(root_.string())));
  }
}

TEST_F(ArtifactsTest, ADirectoryWithoutChecksumsOrAStagingCopyIsNotFound) {
  WriteTestFile(root_ / "alice/plain/file", "x");
  WriteArtifact(root_ / "alice/.s1.staging-1-1", {{"a", "b"}}, true);
  EXPECT_EQ(Store().Resolve("alice", "tally://plain").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Store().Resolve("alice", "tally://.s1.staging-1-1").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ArtifactsTest, ListsKindsRecordsAndModelFilter) {
  WriteArtifact(root_ / "alice/a/state", {{"model.safetensors", "abcd"}}, true);
  WriteArtifact(root_ / "alice/b/export", {{"model.safetensors", "xy"}}, false);
  WriteArtifact(root_ / "alice/.hidden", {{"m", "x"}}, true);
  WriteArtifact(root_ / "bob/theirs", {{"m", "x"}}, true);
  ArtifactRecord record;
  record.model_id = "m1";
  record.step = 7;
  record.created = absl::FromUnixSeconds(1000);
  record.expires = ExpiryOf(record.created, 60);
  ASSERT_TRUE(Store().Record((root_ / "alice/a/state").string(), record).ok());

  std::vector<v1::Artifact> all = Store().List("alice", "").value();
  ASSERT_EQ(all.size(), 2);
  EXPECT_EQ(all[0].handle(), "tally://a/state");
  EXPECT_EQ(all[0].kind(), v1::ARTIFACT_KIND_STATE);
  EXPECT_EQ(all[0].model_id(), "m1");
  EXPECT_EQ(all[0].step(), 7);
  EXPECT_EQ(all[0].created_unix_seconds(), 1000);
  EXPECT_EQ(all[0].expires_unix_seconds(), 1060);
  EXPECT_EQ(all[1].handle(), "tally://b/export");
  EXPECT_EQ(all[1].kind(), v1::ARTIFACT_KIND_EXPORT);
  EXPECT_EQ(all[1].expires_unix_seconds(), 0);
  EXPECT_GT(all[1].size_bytes(), 2);

  std::vector<v1::Artifact> of_m1 = Store().List("alice", "m1").value();
  ASSERT_EQ(of_m1.size(), 1);
  EXPECT_EQ(of_m1[0].handle(), "tally://a/state");
}

TEST_F(ArtifactsTest, DeleteRemovesTheDirectory) {
  WriteArtifact(root_ / "alice/s1", {{"m", "x"}}, true);
  EXPECT_EQ(Store().Delete("bob", "tally://s1").status().code(),
            absl::StatusCode::kNotFound);
  absl::StatusOr<v1::Artifact> deleted = Store().Delete("alice", "tally://s1");
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(deleted->handle(), "tally://s1");
  EXPECT_FALSE(fs::exists(root_ / "alice/s1"));
  EXPECT_EQ(Store().Delete("alice", "tally://s1").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ArtifactsTest, SweepDeletesExactlyTheExpiredOnes) {
  WriteArtifact(root_ / "alice/short", {{"m", "x"}}, true);
  WriteArtifact(root_ / "bob/long", {{"m", "x"}}, false);
  WriteArtifact(root_ / "alice/forever", {{"m", "x"}}, true);
  const absl::Time t0 = absl::FromUnixSeconds(1'700'000'000);
  ArtifactRecord short_lived;
  short_lived.created = t0;
  short_lived.expires = ExpiryOf(t0, 10);
  ArtifactRecord long_lived = short_lived;
  long_lived.expires = ExpiryOf(t0, 100);
  ArtifactRecord forever = short_lived;
  forever.expires = ExpiryOf(t0, 0);
  ASSERT_TRUE(
      Store().Record((root_ / "alice/short").string(), short_lived).ok());
  ASSERT_TRUE(Store().Record((root_ / "bob/long").string(), long_lived).ok());
  ASSERT_TRUE(Store().Record((root_ / "alice/forever").string(), forever).ok());

  EXPECT_EQ(Store().SweepExpired(t0 + absl::Seconds(9)), 0);
  EXPECT_TRUE(fs::exists(root_ / "alice/short"));
  EXPECT_EQ(Store().SweepExpired(t0 + absl::Seconds(10)), 1);
  EXPECT_FALSE(fs::exists(root_ / "alice/short"));
  EXPECT_TRUE(fs::exists(root_ / "bob/long"));
  EXPECT_EQ(Store().SweepExpired(t0 + absl::Hours(1000)), 1);
  EXPECT_FALSE(fs::exists(root_ / "bob/long"));
  EXPECT_TRUE(fs::exists(root_ / "alice/forever"));
}

TEST_F(ArtifactsTest, ManifestListsChecksummedFilesThenTheList) {
  WriteArtifact(root_ / "alice/s1", {{"a.bin", "hello"}, {"b.bin", ""}}, false);
  ArtifactRecord record;
  ASSERT_TRUE(Store().Record((root_ / "alice/s1").string(), record).ok());
  std::vector<v1::ArtifactFile> files =
      Store().Manifest((root_ / "alice/s1").string()).value();
  std::vector<std::string> names;
  for (const auto& file : files) names.push_back(file.path());
  // The record is not part of a download.
  EXPECT_THAT(names, ElementsAre("a.bin", "b.bin", "checksums.sha256"));
  EXPECT_EQ(files[0].size_bytes(), 5);
  EXPECT_EQ(files[0].sha256(), HexDigestOf("hello"));
  std::ifstream list(root_ / "alice/s1/checksums.sha256");
  const std::string text((std::istreambuf_iterator<char>(list)), {});
  EXPECT_EQ(files[2].sha256(), HexDigestOf(text));
}

TEST_F(ArtifactsTest, AMalformedOrEscapingListIsDataLoss) {
  WriteTestFile(root_ / "alice/s1/checksums.sha256",
                absl::StrCat(std::string(64, 'a'), "  ../../etc/passwd\n"));
  EXPECT_EQ(Store().Manifest((root_ / "alice/s1").string()).status().code(),
            absl::StatusCode::kDataLoss);
  WriteTestFile(root_ / "alice/s2/checksums.sha256",
                absl::StrCat(std::string(64, 'a'), "  missing\n"));
  EXPECT_EQ(Store().Manifest((root_ / "alice/s2").string()).status().code(),
            absl::StatusCode::kDataLoss);
}

// Reads the whole download from `offset` in chunks of `chunk` bytes.
std::string ReadFrom(const fs::path& dir,
                     const std::vector<v1::ArtifactFile>& files,
                     uint64_t offset, uint64_t chunk) {
  ArtifactReader reader(dir.string(), files, offset, chunk);
  EXPECT_TRUE(reader.Validate().ok());
  std::string bytes;
  v1::DownloadArtifactChunk piece;
  uint64_t expected_offset = offset;
  while (reader.Next(&piece).value()) {
    EXPECT_EQ(piece.offset(), expected_offset);
    EXPECT_LE(piece.data().size(), chunk);
    expected_offset += piece.data().size();
    bytes += piece.data();
  }
  return bytes;
}

TEST_F(ArtifactsTest, ReaderChunksAndResumesFromAnyOffset) {
  WriteArtifact(root_ / "alice/s1", {{"a", "0123456789"}, {"b", "abcdef"}},
                false);
  const fs::path dir = root_ / "alice/s1";
  std::vector<v1::ArtifactFile> files = Store().Manifest(dir.string()).value();
  const std::string whole = ReadFrom(dir, files, 0, 4);
  std::ifstream list(dir / "checksums.sha256");
  const std::string text((std::istreambuf_iterator<char>(list)), {});
  EXPECT_EQ(whole, absl::StrCat("0123456789", "abcdef", text));
  for (uint64_t offset = 0; offset <= whole.size(); ++offset) {
    EXPECT_EQ(ReadFrom(dir, files, offset, 3), whole.substr(offset)) << offset;
  }
  // A piece never spans two files: the second file starts a chunk.
  ArtifactReader reader(dir.string(), files, 8, 100);
  v1::DownloadArtifactChunk piece;
  ASSERT_TRUE(reader.Next(&piece).value());
  EXPECT_EQ(piece.path(), "a");
  EXPECT_EQ(piece.file_offset(), 8);
  EXPECT_EQ(piece.data(), "89");
  ASSERT_TRUE(reader.Next(&piece).value());
  EXPECT_EQ(piece.path(), "b");
  EXPECT_EQ(piece.file_offset(), 0);
}

TEST_F(ArtifactsTest, ReaderRefusesAnOffsetPastTheEndAndATruncatedFile) {
  WriteArtifact(root_ / "alice/s1", {{"a", "0123456789"}}, false);
  const fs::path dir = root_ / "alice/s1";
  std::vector<v1::ArtifactFile> files = Store().Manifest(dir.string()).value();
  uint64_t total = 0;
  for (const auto& file : files) total += file.size_bytes();
  EXPECT_EQ(
      ArtifactReader(dir.string(), files, total + 1).Validate().status().code(),
      absl::StatusCode::kOutOfRange);
  WriteTestFile(dir / "a", "01234");  // truncated after the manifest was made
  ArtifactReader reader(dir.string(), files, 0);
  v1::DownloadArtifactChunk piece;
  EXPECT_EQ(reader.Next(&piece).status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace tally
