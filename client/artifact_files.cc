#include "client/artifact_files.h"

#include <openssl/evp.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <system_error>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

absl::Status CheckPlainName(const std::string& name) {
  if (name.empty() || name == "." || name == ".." ||
      absl::StrContains(name, '/') || absl::StrContains(name, '\0')) {
    return absl::DataLossError(absl::StrCat("the server's manifest names '",
                                            name.substr(0, 64),
                                            "', not a file name"));
  }
  return absl::OkStatus();
}

// The SHA-256 (hex) of the file at `path`.
absl::StatusOr<std::string> FileSha256(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(
      EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr);
  std::string buffer(1 << 20, '\0');
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    EVP_DigestUpdate(context.get(), buffer.data(),
                     static_cast<size_t>(in.gcount()));
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_DigestFinal_ex(context.get(), digest, &size);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), size));
}

}  // namespace

absl::StatusOr<uint64_t> ResumeOffset(const std::string& dir,
                                      const ArtifactManifest& manifest) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) {
    return absl::ErrnoToStatus(error.value(), absl::StrCat("create ", dir));
  }
  uint64_t offset = 0;
  bool resumed = false;  // the files after the resume point are fetched anew
  for (const v1::ArtifactFile& file : manifest) {
    if (absl::Status name = CheckPlainName(file.path()); !name.ok()) {
      return name;
    }
    const fs::path path = fs::path(dir) / file.path();
    if (resumed) {
      fs::remove(path, error);
      continue;
    }
    uintmax_t have = 0;
    if (fs::exists(path, error)) {
      have = fs::file_size(path, error);
      if (error) have = 0;
    }
    if (have > file.size_bytes()) {
      fs::resize_file(path, 0, error);
      have = 0;
    }
    offset += have;
    resumed = have < file.size_bytes();
  }
  return offset;
}

absl::Status WriteChunk(const std::string& dir,
                        const v1::DownloadArtifactChunk& chunk) {
  if (absl::Status name = CheckPlainName(chunk.path()); !name.ok()) {
    return name;
  }
  const fs::path path = fs::path(dir) / chunk.path();
  {
    // Created if missing, never truncated: earlier chunks stay.
    std::ofstream touch(path, std::ios::binary | std::ios::app);
  }
  std::fstream out(path, std::ios::binary | std::ios::in | std::ios::out);
  out.seekp(static_cast<std::streamoff>(chunk.file_offset()));
  out.write(chunk.data().data(),
            static_cast<std::streamsize>(chunk.data().size()));
  if (!out.flush()) {
    return absl::InternalError(absl::StrCat("cannot write ", path.string()));
  }
  return absl::OkStatus();
}

absl::Status VerifyFiles(const std::string& dir,
                         const ArtifactManifest& manifest) {
  for (const v1::ArtifactFile& file : manifest) {
    const fs::path path = fs::path(dir) / file.path();
    std::error_code error;
    if (!fs::exists(path, error) && file.size_bytes() == 0) {
      std::ofstream create(path, std::ios::binary);  // empty files get no data
    }
    absl::StatusOr<std::string> digest = FileSha256(path);
    if (!digest.ok() || *digest != file.sha256()) {
      fs::remove(path, error);
      return absl::DataLossError(absl::StrCat(
          file.path(), " does not match the server's SHA-256 ", file.sha256(),
          " (deleted; download again to fetch it anew)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace tally
