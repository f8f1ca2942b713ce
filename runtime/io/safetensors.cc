#include "runtime/io/safetensors.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/scoped_fd.h"
#include "base/status.h"
#include "runtime/io/safetensors_header.h"

namespace tally {
namespace {

// Tensor bytes are copied between memory and the file as they are.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian");

// Linux transfers at most ~2 GiB per read/write call.
constexpr size_t kMaxIoBytes = size_t{1} << 30;

struct TorchDType {
  SafetensorsDType dtype;
  torch::ScalarType type;
};
constexpr TorchDType kTorchDTypes[] = {
    {SafetensorsDType::kF32, torch::kFloat32},
    {SafetensorsDType::kF64, torch::kFloat64},
    {SafetensorsDType::kF16, torch::kFloat16},
    {SafetensorsDType::kBF16, torch::kBFloat16},
    {SafetensorsDType::kI64, torch::kInt64},
    {SafetensorsDType::kI32, torch::kInt32}};

std::optional<SafetensorsDType> DTypeOf(torch::ScalarType type) {
  for (const TorchDType& d : kTorchDTypes) {
    if (d.type == type) return d.dtype;
  }
  return std::nullopt;
}

torch::ScalarType TypeOf(SafetensorsDType dtype) {
  for (const TorchDType& d : kTorchDTypes) {
    if (d.dtype == dtype) return d.type;
  }
  return torch::kFloat32;  // unreachable: kTorchDTypes covers the enum
}

absl::Status WriteAll(int fd, const char* data, size_t size,
                      const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, std::min(size, kMaxIoBytes));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat("write ", path));
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Reads up to `size` bytes at `offset`; fewer only at end of file.
absl::StatusOr<uint64_t> ReadAt(int fd, uint64_t offset, char* data,
                                uint64_t size, const std::string& path) {
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n =
        ::pread(fd, data + done, std::min<uint64_t>(size - done, kMaxIoBytes),
                static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat("read ", path));
    }
    if (n == 0) break;
    done += static_cast<uint64_t>(n);
  }
  return done;
}

// Incremental SHA-256 over OpenSSL's EVP interface.
class Sha256 {
 public:
  Sha256() : context_(EVP_MD_CTX_new()) {
    ok_ = context_ != nullptr &&
          EVP_DigestInit_ex(context_, EVP_sha256(), nullptr) == 1;
  }
  ~Sha256() { EVP_MD_CTX_free(context_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(const char* data, size_t size) {
    if (ok_ && size > 0) ok_ = EVP_DigestUpdate(context_, data, size) == 1;
  }
  // Lowercase hex of the digest.
  absl::StatusOr<std::string> Finish() {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int size = 0;
    if (!ok_ || EVP_DigestFinal_ex(context_, digest, &size) != 1) {
      return absl::InternalError("SHA-256 failed in libcrypto");
    }
    static constexpr char kHex[] = "0123456789abcdef";
    std::string hex;
    for (unsigned int i = 0; i < size; ++i) {
      hex += kHex[digest[i] >> 4];
      hex += kHex[digest[i] & 0xf];
    }
    return hex;
  }

 private:
  EVP_MD_CTX* context_;
  bool ok_ = false;
};

}  // namespace

absl::StatusOr<std::string> WriteFileDurably(
    const std::string& path, const std::vector<absl::string_view>& pieces) {
  ScopedFd fd(
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("create ", path));
  }
  Sha256 sha256;
  for (absl::string_view piece : pieces) {
    TALLY_RETURN_IF_ERROR(WriteAll(fd.get(), piece.data(), piece.size(), path));
    sha256.Update(piece.data(), piece.size());
  }
  if (::fsync(fd.get()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("fsync ", path));
  }
  if (fd.Close() != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("close ", path));
  }
  return sha256.Finish();
}

absl::Status SyncDirectory(const std::string& dir) {
  ScopedFd fd(::open(dir.empty() ? "." : dir.c_str(),
                     O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0 || ::fsync(fd.get()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("fsync directory ", dir));
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path,
                                 const std::vector<absl::string_view>& pieces) {
  const std::string tmp = path + ".tmp";
  absl::Status status = WriteFileDurably(tmp, pieces).status();
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status =
        absl::ErrnoToStatus(errno, absl::StrCat("rename ", tmp, " to ", path));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  return SyncDirectory(std::filesystem::path(path).parent_path().string());
}

absl::StatusOr<std::string> Sha256OfFile(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  }
  Sha256 sha256;
  std::vector<char> buffer(size_t{1} << 20);
  uint64_t offset = 0;
  while (true) {
    TALLY_ASSIGN_OR_RETURN(uint64_t got, ReadAt(fd.get(), offset, buffer.data(),
                                                buffer.size(), path));
    if (got == 0) break;
    sha256.Update(buffer.data(), got);
    offset += got;
  }
  return sha256.Finish();
}

absl::StatusOr<std::string> Sha256OfBytes(absl::string_view bytes) {
  Sha256 sha256;
  sha256.Update(bytes.data(), bytes.size());
  return sha256.Finish();
}

std::vector<absl::string_view> SerializedSafetensors::Pieces() const {
  std::vector<absl::string_view> pieces = {prefix_and_header};
  for (const torch::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    pieces.emplace_back(static_cast<const char*>(t.data_ptr()),
                        t.numel() * t.element_size());
  }
  return pieces;
}

absl::StatusOr<SerializedSafetensors> SerializeSafetensors(
    const NamedTensors& tensors,
    const std::map<std::string, std::string>& metadata) {
  return CatchTorch(
      "serialize safetensors", [&]() -> absl::StatusOr<SerializedSafetensors> {
        SerializedSafetensors out;
        std::vector<SafetensorsEntry> entries;
        std::set<std::string> names;
        uint64_t offset = 0;
        for (const auto& [name, tensor] : tensors) {
          const std::string where = absl::StrCat("tensor \"", name, "\"");
          if (name == "__metadata__") {
            return absl::InvalidArgumentError(
                absl::StrCat(where, " uses the reserved name"));
          }
          if (!names.insert(name).second) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, " appears more than once"));
          }
          const std::optional<SafetensorsDType> dtype =
              DTypeOf(tensor.scalar_type());
          if (!dtype) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, " has unsupported dtype ",
                             c10::toString(tensor.scalar_type())));
          }
          torch::Tensor t = tensor.detach().to(torch::kCPU).contiguous();
          const uint64_t bytes = t.numel() * t.element_size();
          entries.push_back(
              {name, *dtype, t.sizes().vec(), offset, offset + bytes});
          offset += bytes;
          out.tensors.push_back(std::move(t));
        }
        // Throws (caught above) for names that are not valid UTF-8.
        out.prefix_and_header = EncodeSafetensorsHeader(entries, metadata);
        return out;
      });
}

absl::Status WriteSafetensors(
    const std::string& path, const NamedTensors& tensors,
    const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<SerializedSafetensors> serialized =
      SerializeSafetensors(tensors, metadata);
  if (!serialized.ok()) {
    return absl::Status(
        serialized.status().code(),
        absl::StrCat(path, ": ", serialized.status().message()));
  }
  return WriteFileAtomically(path, serialized->Pieces());
}

absl::StatusOr<NamedTensors> ReadSafetensors(
    const std::string& path, std::map<std::string, std::string>* metadata,
    const SafetensorsScreen& screen) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  }
  struct stat info;
  if (::fstat(fd.get(), &info) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("stat ", path));
  }
  const uint64_t file_size = static_cast<uint64_t>(info.st_size);
  auto corrupt = [&](auto&&... parts) {
    return absl::DataLossError(absl::StrCat(path, ": ", parts...));
  };

  char prefix[kSafetensorsLengthBytes];
  TALLY_ASSIGN_OR_RETURN(uint64_t got,
                         ReadAt(fd.get(), 0, prefix, sizeof(prefix), path));
  absl::StatusOr<uint64_t> header_size =
      ParseSafetensorsHeaderLength(absl::string_view(prefix, got), file_size);
  if (!header_size.ok()) return corrupt(header_size.status().message());
  std::string header_text(*header_size, '\0');
  TALLY_ASSIGN_OR_RETURN(got, ReadAt(fd.get(), kSafetensorsLengthBytes,
                                     header_text.data(), *header_size, path));
  if (got != *header_size) return corrupt("file ends inside the header");
  absl::StatusOr<SafetensorsHeader> header =
      ParseSafetensorsHeader(header_text, file_size);
  if (!header.ok()) return corrupt(header.status().message());
  if (metadata != nullptr) {
    for (auto& [key, value] : header->metadata) (*metadata)[key] = value;
  }

  std::vector<const SafetensorsEntry*> wanted;
  for (const SafetensorsEntry& entry : header->tensors) {
    ScreenVerdict verdict = ScreenVerdict::kRead;
    if (screen) {
      absl::StatusOr<ScreenVerdict> screened = screen(entry);
      if (!screened.ok()) {
        return absl::Status(
            screened.status().code(),
            absl::StrCat(path, ": ", screened.status().message()));
      }
      verdict = *screened;
    }
    if (verdict == ScreenVerdict::kRead) wanted.push_back(&entry);
  }

  return CatchTorch("read safetensors", [&]() -> absl::StatusOr<NamedTensors> {
    NamedTensors tensors;
    tensors.reserve(wanted.size());
    for (const SafetensorsEntry* wanted_entry : wanted) {
      const SafetensorsEntry& entry = *wanted_entry;
      torch::Tensor t = torch::empty(entry.shape, TypeOf(entry.dtype));
      const uint64_t span = entry.end - entry.begin;
      TALLY_ASSIGN_OR_RETURN(
          uint64_t read, ReadAt(fd.get(), header->data_start + entry.begin,
                                static_cast<char*>(t.data_ptr()), span, path));
      if (read != span) {
        return corrupt("tensor \"", entry.name,
                       "\": file ends inside its data");
      }
      tensors.emplace_back(entry.name, std::move(t));
    }
    return tensors;
  });
}

}  // namespace tally
