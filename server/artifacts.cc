#include "server/artifacts.h"

#include <openssl/evp.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/file_text.h"
#include "base/json_reader.h"
#include "base/log.h"
#include "base/status.h"
#include "server/path_confinement.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

// The names runtime/checkpoint writes (checkpoint.h), repeated here to keep
// this file free of LibTorch.
constexpr char kChecksums[] = "checksums.sha256";
constexpr char kTallyJson[] = "tally.json";
constexpr char kRecordFile[] = ".tally-artifact.json";
// A checksum list names a few dozen files (HF shards); this bounds a read.
constexpr uint64_t kMaxChecksumsBytes = uint64_t{1} << 20;

bool IsArtifactDir(const fs::path& dir) {
  std::error_code error;
  return fs::is_directory(dir, error) &&
         fs::is_regular_file(dir / kChecksums, error);
}

std::string Sha256Hex(const std::string& data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(data.data(), data.size(), digest, &size, EVP_sha256(), nullptr);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), size));
}

int64_t UnixSeconds(absl::Time time) {
  return time == absl::InfiniteFuture() ? 0 : absl::ToUnixSeconds(time);
}

// The record in `dir`, or none (an artifact this server did not record).
std::optional<ArtifactRecord> ReadRecord(const fs::path& dir) {
  absl::StatusOr<nlohmann::json> json =
      ReadJsonFile((dir / kRecordFile).string(), kConfigJsonLimits,
                   absl::StatusCode::kDataLoss);
  if (!json.ok() || !json->is_object()) return std::nullopt;
  ArtifactRecord record;
  record.model_id = json->value("model_id", "");
  record.step = json->value("step", int64_t{0});
  record.created = absl::FromUnixSeconds(json->value("created", int64_t{0}));
  const int64_t expires = json->value("expires", int64_t{0});
  if (expires > 0) record.expires = absl::FromUnixSeconds(expires);
  return record;
}

uint64_t DirectoryBytes(const fs::path& dir) {
  uint64_t bytes = 0;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end;
       it.increment(error)) {
    std::error_code size_error;
    if (it->is_regular_file(size_error)) {
      const uintmax_t size = it->file_size(size_error);
      if (!size_error) bytes += size;
    }
  }
  return bytes;
}

// A file name checksums.sha256 may list: one plain name in the directory.
bool IsPlainName(absl::string_view name) {
  return !name.empty() && name != "." && name != ".." &&
         !absl::StrContains(name, '/') && !absl::StrContains(name, '\0');
}

}  // namespace

absl::Time ExpiryOf(absl::Time created, uint64_t ttl_seconds) {
  if (ttl_seconds == 0) return absl::InfiniteFuture();
  return created + absl::Seconds(static_cast<int64_t>(
                       std::min<uint64_t>(ttl_seconds, uint64_t{1} << 40)));
}

std::string ArtifactStore::TenantRoot(const std::string& tenant) const {
  return tenant.empty() ? root_ : (fs::path(root_) / tenant).string();
}

absl::StatusOr<std::string> ArtifactStore::Resolve(const std::string& tenant,
                                                   const std::string& handle,
                                                   const char* field) const {
  if (!absl::StartsWith(handle, kHandleScheme)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be a handle \"", kHandleScheme,
                     "<path>\", not '", handle.substr(0, 64), "'"));
  }
  const std::string path = handle.substr(sizeof(kHandleScheme) - 1);
  const fs::path relative(path);
  if (path.empty() || relative.is_absolute() ||
      path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must name a path relative to the tenant's root, not '",
        handle.substr(0, 64), "'"));
  }
  for (const fs::path& part : relative) {
    if (part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " may not contain '..'"));
    }
  }
  const absl::Status not_found =
      absl::NotFoundError(absl::StrCat("no artifact ", handle));
  const std::string tenant_root = TenantRoot(tenant);
  std::error_code error;
  if (!fs::is_directory(tenant_root, error)) return not_found;
  absl::StatusOr<std::string> dir = ConfineToRoot(tenant_root, path);
  if (absl::IsPermissionDenied(dir.status())) {
    // Its message names server paths: this one does not.
    return absl::InvalidArgumentError(absl::StrCat(
        field, " ", handle, " leads out of the tenant's root (a symlink)"));
  }
  TALLY_RETURN_IF_ERROR(dir.status());
  // A save's hidden staging or previous copy is not an artifact.
  for (const fs::path& part : relative) {
    if (absl::StartsWith(part.string(), ".")) return not_found;
  }
  if (!IsArtifactDir(*dir)) return not_found;
  return *dir;
}

absl::StatusOr<std::string> ArtifactStore::HandleOf(
    const std::string& tenant, const std::string& dir) const {
  std::error_code error;
  const fs::path real_root = fs::canonical(TenantRoot(tenant), error);
  if (error) {
    return absl::ErrnoToStatus(error.value(), "the tenant's checkpoint root");
  }
  const fs::path relative = fs::path(dir).lexically_relative(real_root);
  if (relative.empty() || *relative.begin() == "..") {
    return absl::InternalError("a saved directory outside the tenant's root");
  }
  return absl::StrCat(kHandleScheme, relative.generic_string());
}

absl::Status ArtifactStore::Record(const std::string& dir,
                                   const ArtifactRecord& record) const {
  const nlohmann::json json = {{"model_id", record.model_id},
                               {"step", record.step},
                               {"created", absl::ToUnixSeconds(record.created)},
                               {"expires", UnixSeconds(record.expires)}};
  const fs::path target = fs::path(dir) / kRecordFile;
  const fs::path staging = fs::path(dir) / absl::StrCat(kRecordFile, ".tmp");
  {
    std::ofstream out(staging, std::ios::trunc);
    out << json.dump();
    if (!out.flush()) {
      return absl::InternalError(
          absl::StrCat("cannot write the artifact record in ", dir));
    }
  }
  std::error_code error;
  fs::rename(staging, target, error);
  if (error) {
    return absl::ErrnoToStatus(error.value(),
                               absl::StrCat("publish ", target.string()));
  }
  return absl::OkStatus();
}

v1::Artifact ArtifactStore::Describe(const std::string& dir,
                                     const std::string& handle) const {
  v1::Artifact artifact;
  artifact.set_handle(handle);
  std::error_code error;
  artifact.set_kind(fs::exists(fs::path(dir) / kTallyJson, error)
                        ? v1::ARTIFACT_KIND_STATE
                        : v1::ARTIFACT_KIND_EXPORT);
  artifact.set_size_bytes(DirectoryBytes(dir));
  if (const std::optional<ArtifactRecord> record = ReadRecord(dir)) {
    artifact.set_model_id(record->model_id);
    artifact.set_step(record->step);
    artifact.set_created_unix_seconds(absl::ToUnixSeconds(record->created));
    artifact.set_expires_unix_seconds(UnixSeconds(record->expires));
  } else {
    const auto written = fs::last_write_time(fs::path(dir) / kChecksums, error);
    if (!error) {
      // file_time_type's epoch is unspecified: convert through now.
      const auto age = fs::file_time_type::clock::now() - written;
      artifact.set_created_unix_seconds(absl::ToUnixSeconds(
          absl::Now() -
          absl::FromChrono(
              std::chrono::duration_cast<std::chrono::seconds>(age))));
    }
  }
  return artifact;
}

std::vector<std::pair<std::string, std::string>> ArtifactStore::Walk(
    const std::string& tenant_root) const {
  std::vector<std::pair<std::string, std::string>> found;
  std::error_code error;
  fs::recursive_directory_iterator it(tenant_root, error), end;
  for (; !error && it != end; it.increment(error)) {
    std::error_code type_error;
    if (!it->is_directory(type_error) || it->is_symlink(type_error)) continue;
    if (absl::StartsWith(it->path().filename().string(), ".")) {
      it.disable_recursion_pending();
      continue;
    }
    if (IsArtifactDir(it->path())) {
      it.disable_recursion_pending();
      found.emplace_back(
          it->path().string(),
          it->path().lexically_relative(tenant_root).generic_string());
    }
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.second < b.second; });
  return found;
}

absl::StatusOr<std::vector<v1::Artifact>> ArtifactStore::List(
    const std::string& tenant, const std::string& model_id) const {
  std::vector<v1::Artifact> artifacts;
  for (const auto& [dir, relative] : Walk(TenantRoot(tenant))) {
    v1::Artifact artifact =
        Describe(dir, absl::StrCat(kHandleScheme, relative));
    if (model_id.empty() || artifact.model_id() == model_id) {
      artifacts.push_back(std::move(artifact));
    }
  }
  return artifacts;
}

absl::StatusOr<v1::Artifact> ArtifactStore::Delete(
    const std::string& tenant, const std::string& handle) const {
  TALLY_ASSIGN_OR_RETURN(const std::string dir, Resolve(tenant, handle));
  v1::Artifact deleted = Describe(dir, handle);
  std::error_code error;
  fs::remove_all(dir, error);
  if (error) {
    return absl::ErrnoToStatus(error.value(), absl::StrCat("delete ", handle));
  }
  return deleted;
}

absl::StatusOr<std::vector<v1::ArtifactFile>> ArtifactStore::Manifest(
    const std::string& dir) const {
  const std::string list_path = (fs::path(dir) / kChecksums).string();
  absl::StatusOr<std::string> list =
      ReadFileUpTo(list_path, kMaxChecksumsBytes, absl::StatusCode::kDataLoss);
  if (!list.ok()) {
    return absl::DataLossError(
        absl::StrCat("the artifact's ", kChecksums, " cannot be read"));
  }
  std::vector<v1::ArtifactFile> files;
  for (absl::string_view line : absl::StrSplit(*list, '\n')) {
    if (line.empty()) continue;
    // sha256sum's format: "<64 hex>  <name>".
    if (line.size() < 67 || line.substr(64, 2) != "  " ||
        !IsPlainName(line.substr(66))) {
      return absl::DataLossError(
          absl::StrCat("the artifact's ", kChecksums, " has a malformed line"));
    }
    v1::ArtifactFile& file = files.emplace_back();
    file.set_sha256(absl::AsciiStrToLower(line.substr(0, 64)));
    file.set_path(std::string(line.substr(66)));
    std::error_code error;
    const uintmax_t size = fs::file_size(fs::path(dir) / file.path(), error);
    if (error) {
      return absl::DataLossError(absl::StrCat(
          "the artifact's file ", file.path(), " is missing or unreadable"));
    }
    file.set_size_bytes(size);
  }
  v1::ArtifactFile& itself = files.emplace_back();
  itself.set_path(kChecksums);
  itself.set_size_bytes(list->size());
  itself.set_sha256(Sha256Hex(*list));
  return files;
}

int ArtifactStore::SweepExpired(absl::Time now) const {
  int deleted = 0;
  for (const auto& [dir, relative] : Walk(root_)) {
    const std::optional<ArtifactRecord> record = ReadRecord(dir);
    if (!record.has_value() || record->expires > now) continue;
    std::error_code error;
    fs::remove_all(dir, error);
    if (error) {
      Log(LogLevel::kWarning, absl::StrCat("deleting the expired artifact ",
                                           relative, ": ", error.message()));
      continue;
    }
    Log(LogLevel::kInfo,
        absl::StrCat("deleted the expired artifact ", relative));
    ++deleted;
  }
  return deleted;
}

ArtifactReader::ArtifactReader(std::string dir,
                               std::vector<v1::ArtifactFile> manifest,
                               uint64_t offset, uint64_t chunk_bytes)
    : dir_(std::move(dir)),
      manifest_(std::move(manifest)),
      offset_(offset),
      chunk_bytes_(std::max<uint64_t>(chunk_bytes, 1)) {}

absl::StatusOr<uint64_t> ArtifactReader::Validate() const {
  uint64_t total = 0;
  for (const v1::ArtifactFile& file : manifest_) total += file.size_bytes();
  if (offset_ > total) {
    return absl::OutOfRangeError(absl::StrCat(
        "offset ", offset_, " lies past the artifact's ", total, " bytes"));
  }
  return total;
}

absl::StatusOr<bool> ArtifactReader::Next(v1::DownloadArtifactChunk* chunk) {
  uint64_t start = 0;  // of the current file in the concatenation
  for (const v1::ArtifactFile& file : manifest_) {
    const uint64_t end = start + file.size_bytes();
    if (offset_ >= end) {
      start = end;
      continue;
    }
    const uint64_t file_offset = offset_ - start;
    const uint64_t length = std::min(chunk_bytes_, end - offset_);
    std::ifstream in(fs::path(dir_) / file.path(), std::ios::binary);
    std::string data(length, '\0');
    in.seekg(static_cast<std::streamoff>(file_offset));
    in.read(data.data(), static_cast<std::streamsize>(length));
    if (static_cast<uint64_t>(in.gcount()) != length) {
      return absl::DataLossError(
          absl::StrCat("the artifact's file ", file.path(),
                       " is shorter than its manifest says"));
    }
    chunk->Clear();
    chunk->set_path(file.path());
    chunk->set_file_offset(file_offset);
    chunk->set_offset(offset_);
    chunk->set_data(std::move(data));
    offset_ += length;
    return true;
  }
  return false;
}

}  // namespace tally
