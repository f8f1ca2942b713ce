// DirectoryIdentity: the same for a directory left alone, another one once
// what identifies it changes: the checksum list of a tally checkpoint or
// export, or for an HF directory its config.json bytes and the names and
// sizes of its files. Never the weights' bytes themselves, nor modification
// times (each host's copy of a download has its own).
#include "runtime/checkpoint/directory_identity.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/checkpoint_manifest.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

class DirectoryIdentityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::path(::testing::TempDir()) / "identity_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ + "/" + name, std::ios::trunc) << text;
  }

  std::string dir_;
};

TEST_F(DirectoryIdentityTest, AnHfDirectoryIsItsConfigAndItsFileList) {
  Write("config.json", R"({"hidden_size": 32})");
  Write("model.safetensors", "weights");
  const std::string identity = DirectoryIdentity(dir_);
  EXPECT_EQ(identity.rfind("sha256 ", 0), 0u) << identity;
  EXPECT_EQ(DirectoryIdentity(dir_), identity);
  EXPECT_EQ(DirectoryIdentity(dir_ + "/"), identity);
  // Another config.
  Write("config.json", R"({"hidden_size": 64})");
  const std::string other_config = DirectoryIdentity(dir_);
  EXPECT_NE(other_config, identity);
  // A weights file of another size, or a new file.
  Write("model.safetensors", "more weights");
  EXPECT_NE(DirectoryIdentity(dir_), other_config);
  const std::string grown = DirectoryIdentity(dir_);
  Write("model-00002.safetensors", "x");
  EXPECT_NE(DirectoryIdentity(dir_), grown);
}

TEST_F(DirectoryIdentityTest, CopiesWrittenAtOtherTimesAreTheSame) {
  Write("config.json", R"({"hidden_size": 32})");
  Write("model.safetensors", "weights");
  const std::string identity = DirectoryIdentity(dir_);
  // As another host's copy of the same download: written at another time.
  const fs::file_time_type later =
      fs::last_write_time(dir_ + "/model.safetensors") + std::chrono::hours(5);
  fs::last_write_time(dir_ + "/model.safetensors", later);
  fs::last_write_time(dir_ + "/config.json", later);
  EXPECT_EQ(DirectoryIdentity(dir_), identity);
}

TEST_F(DirectoryIdentityTest, AListedDirectoryIsItsChecksumList) {
  Write("config.json", R"({"hidden_size": 32})");
  Write("checksums.sha256", "aaaa  config.json\n");
  const std::string listed = DirectoryIdentity(dir_);
  // Files the list covers are verified when read: the list decides.
  Write("config.json", R"({"hidden_size": 64})");
  EXPECT_EQ(DirectoryIdentity(dir_), listed);
  Write("checksums.sha256", "bbbb  config.json\n");
  EXPECT_NE(DirectoryIdentity(dir_), listed);
}

TEST_F(DirectoryIdentityTest, WhatCannotBeReadIsUnreadable) {
  EXPECT_EQ(DirectoryIdentity(dir_ + "/missing"), "unreadable");
  EXPECT_EQ(DirectoryIdentity(dir_), "unreadable");  // no config.json
}

TEST_F(DirectoryIdentityTest, TheBaseKeyCarriesTheIdentity) {
  Write("config.json", R"({"hidden_size": 32})");
  ModelSpec spec;
  spec.model_id = "t/a";
  spec.lora.rank = 2;
  spec.init_checkpoint = dir_;
  const std::string key = CurrentBaseKey(spec);
  EXPECT_EQ(key, BaseKey(spec, DirectoryIdentity(dir_)));
  Write("config.json", R"({"hidden_size": 64})");
  EXPECT_NE(CurrentBaseKey(spec), key);
  spec.lora.rank = 0;
  EXPECT_EQ(CurrentBaseKey(spec), "");
}

TEST_F(DirectoryIdentityTest, AnAdapterStateChecksTheBaseItRecorded) {
  Write("config.json", R"({"hidden_size": 32})");
  CheckpointManifest manifest;
  manifest.lora.rank = 2;
  manifest.base_checkpoint = dir_;
  // An older state records no identity: nothing to check.
  EXPECT_TRUE(CheckAdapterBase(manifest, "/ckpt/s1", dir_).ok());
  manifest.base_identity = DirectoryIdentity(dir_);
  EXPECT_TRUE(CheckAdapterBase(manifest, "/ckpt/s1", dir_).ok());
  Write("config.json", R"({"hidden_size": 64})");
  const absl::Status changed = CheckAdapterBase(manifest, "/ckpt/s1", dir_);
  EXPECT_EQ(changed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(changed.message().find("the LoRA base " + dir_ +
                                   " of adapter state /ckpt/s1"),
            std::string::npos)
      << changed;
}

TEST_F(DirectoryIdentityTest, TheManifestKeepsTheBaseIdentity) {
  CheckpointManifest manifest;
  manifest.trainable_only = true;
  manifest.lora.rank = 2;
  manifest.lora.alpha = 4.0;
  manifest.base_checkpoint = "/models/base";
  manifest.base_identity = "sha256 abc";
  Write("tally.json", ManifestToJson(manifest));
  absl::StatusOr<std::optional<CheckpointManifest>> read =
      ReadManifestIfAny(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->base_checkpoint, "/models/base");
  EXPECT_EQ((*read)->base_identity, "sha256 abc");
  // None in an older state; no tally.json in an HF directory.
  manifest.base_identity.clear();
  Write("tally.json", ManifestToJson(manifest));
  read = ReadManifestIfAny(dir_);
  ASSERT_TRUE(read.ok() && read->has_value()) << read.status();
  EXPECT_EQ((*read)->base_identity, "");
  fs::remove(dir_ + "/tally.json");
  read = ReadManifestIfAny(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_FALSE(read->has_value());
}

}  // namespace
}  // namespace tally
