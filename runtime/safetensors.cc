#include "runtime/safetensors.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>
#include <variant>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace tally {
namespace {

// Tensor bytes are copied between memory and the file as they are.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian");

constexpr uint64_t kHeaderLengthBytes = 8;
// The reference implementation's limit: a longer header means a corrupt
// length prefix, not a real file.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
// Linux transfers at most ~2 GiB per read/write call.
constexpr size_t kMaxIoBytes = size_t{1} << 30;

struct DTypeCode {
  const char* code;
  torch::ScalarType type;
};
constexpr DTypeCode kDTypeCodes[] = {
    {"F32", torch::kFloat32}, {"F64", torch::kFloat64},
    {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16},
    {"I64", torch::kInt64},   {"I32", torch::kInt32}};

const char* CodeOf(torch::ScalarType type) {
  for (const DTypeCode& d : kDTypeCodes) {
    if (d.type == type) return d.code;
  }
  return nullptr;
}

std::optional<torch::ScalarType> TypeOf(const std::string& code) {
  for (const DTypeCode& d : kDTypeCodes) {
    if (code == d.code) return d.type;
  }
  return std::nullopt;
}

class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  // Closes now, reporting the error a deferred close would swallow.
  int Close() {
    const int result = ::close(fd_);
    fd_ = -1;
    return result;
  }

 private:
  int fd_;
};

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

// The parsed header entry of one tensor.
struct TensorEntry {
  std::string name;
  torch::ScalarType type;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Validates one header entry against a data buffer of `data_size` bytes.
// Returns the reason it is malformed, or the parsed entry.
std::variant<std::string, TensorEntry> ParseEntry(
    const std::string& name, const nlohmann::ordered_json& value,
    uint64_t data_size) {
  if (!value.is_object()) return std::string("entry is not a JSON object");
  TensorEntry entry;
  entry.name = name;

  const auto dtype = value.find("dtype");
  if (dtype == value.end() || !dtype->is_string()) {
    return std::string("dtype is missing or not a string");
  }
  const std::optional<torch::ScalarType> type =
      TypeOf(dtype->get<std::string>());
  if (!type) return absl::StrCat("unknown dtype ", dtype->dump());
  entry.type = *type;

  const auto shape = value.find("shape");
  if (shape == value.end() || !shape->is_array()) {
    return std::string("shape is missing or not an array");
  }
  // Element count, saturating so an absurd shape cannot wrap around.
  constexpr uint64_t kMax = std::numeric_limits<int64_t>::max();
  uint64_t numel = 1;
  for (const nlohmann::ordered_json& dim : *shape) {
    if (!dim.is_number_unsigned() || dim.get<uint64_t>() > kMax) {
      return absl::StrCat("shape ", shape->dump(),
                          " holds a value that is not a dimension");
    }
    const uint64_t d = dim.get<uint64_t>();
    numel = (d != 0 && numel > kMax / d) ? kMax : numel * d;
    entry.shape.push_back(static_cast<int64_t>(d));
  }

  const auto offsets = value.find("data_offsets");
  if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    return std::string("data_offsets is not a [begin, end] pair");
  }
  entry.begin = (*offsets)[0].get<uint64_t>();
  entry.end = (*offsets)[1].get<uint64_t>();
  if (entry.begin > entry.end || entry.end > data_size) {
    return absl::StrCat("data_offsets [", entry.begin, ", ", entry.end,
                        "] fall outside the data buffer of ", data_size,
                        " bytes");
  }
  const uint64_t itemsize = c10::elementSize(entry.type);
  const uint64_t span = entry.end - entry.begin;
  if (numel > kMax / itemsize || numel * itemsize != span) {
    return absl::StrCat("shape ", shape->dump(), " of dtype ",
                        dtype->get<std::string>(), " does not fill its ", span,
                        "-byte data_offsets span");
  }
  return entry;
}

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
        // Built by hand rather than as one ordered_json, whose key lookup is
        // linear per insert.
        std::string header = "{";
        auto append_entry = [&](const std::string& key,
                                const nlohmann::ordered_json& value) {
          if (header.size() > 1) header += ',';
          header += nlohmann::json(key).dump();
          header += ':';
          header += value.dump();
        };
        if (!metadata.empty()) append_entry("__metadata__", metadata);

        SerializedSafetensors out;
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
          const char* code = CodeOf(tensor.scalar_type());
          if (code == nullptr) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, " has unsupported dtype ",
                             c10::toString(tensor.scalar_type())));
          }
          torch::Tensor t = tensor.detach().to(torch::kCPU).contiguous();
          const uint64_t bytes = t.numel() * t.element_size();
          nlohmann::ordered_json entry;
          entry["dtype"] = code;
          entry["shape"] = t.sizes().vec();
          entry["data_offsets"] = {offset, offset + bytes};
          append_entry(name, entry);
          offset += bytes;
          out.tensors.push_back(std::move(t));
        }
        header += '}';
        // Spaces are JSON whitespace; they align the data start to 8 bytes.
        header.append((8 - header.size() % 8) % 8, ' ');

        for (size_t i = 0; i < kHeaderLengthBytes; ++i) {
          out.prefix_and_header += static_cast<char>(
              (static_cast<uint64_t>(header.size()) >> (8 * i)) & 0xff);
        }
        out.prefix_and_header += header;
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
    const std::string& path, std::map<std::string, std::string>* metadata) {
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

  unsigned char prefix[kHeaderLengthBytes];
  TALLY_ASSIGN_OR_RETURN(uint64_t got,
                         ReadAt(fd.get(), 0, reinterpret_cast<char*>(prefix),
                                sizeof(prefix), path));
  if (got != sizeof(prefix)) {
    return corrupt("file of ", file_size,
                   " bytes is too short for the 8-byte header length");
  }
  uint64_t header_size = 0;
  for (size_t i = 0; i < kHeaderLengthBytes; ++i) {
    header_size |= uint64_t{prefix[i]} << (8 * i);
  }
  if (header_size > kMaxHeaderBytes ||
      header_size > file_size - kHeaderLengthBytes) {
    return corrupt("header length ", header_size, " does not fit the ",
                   file_size, "-byte file");
  }
  std::string header_text(header_size, '\0');
  TALLY_ASSIGN_OR_RETURN(got, ReadAt(fd.get(), kHeaderLengthBytes,
                                     header_text.data(), header_size, path));
  if (got != header_size) return corrupt("file ends inside the header");
  // Ordered, so tensors sharing an offset (empty ones) keep header order.
  const nlohmann::ordered_json header = nlohmann::ordered_json::parse(
      header_text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return corrupt("header is not valid JSON");
  if (!header.is_object()) return corrupt("header is not a JSON object");

  const uint64_t data_start = kHeaderLengthBytes + header_size;
  const uint64_t data_size = file_size - data_start;
  std::vector<TensorEntry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return corrupt("__metadata__ is not an object");
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) {
          return corrupt("__metadata__ \"", key, "\" is not a string");
        }
        if (metadata != nullptr) (*metadata)[key] = text.get<std::string>();
      }
      continue;
    }
    auto parsed = ParseEntry(name, value, data_size);
    if (auto* why = std::get_if<std::string>(&parsed)) {
      return corrupt("tensor \"", name, "\": ", *why);
    }
    entries.push_back(std::get<TensorEntry>(std::move(parsed)));
  }

  // The tensors must tile the data buffer exactly.
  std::stable_sort(entries.begin(), entries.end(),
                   [](const TensorEntry& a, const TensorEntry& b) {
                     return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
                   });
  uint64_t cursor = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& entry : entries) {
    if (entry.begin < cursor) {
      return corrupt("tensor \"", entry.name, "\": data_offsets [", entry.begin,
                     ", ", entry.end, "] overlap tensor \"", previous->name,
                     "\"");
    }
    if (entry.begin > cursor) {
      return corrupt("tensor \"", entry.name, "\": data_offsets [", entry.begin,
                     ", ", entry.end, "] leave bytes [", cursor, ", ",
                     entry.begin, ") of the data buffer unused");
    }
    cursor = entry.end;
    previous = &entry;
  }
  if (cursor != data_size) {
    return corrupt("the data buffer holds ", data_size,
                   " bytes but its tensors",
                   previous ? absl::StrCat(" (last: \"", previous->name, "\")")
                            : std::string(),
                   " cover only ", cursor);
  }

  return CatchTorch("read safetensors", [&]() -> absl::StatusOr<NamedTensors> {
    NamedTensors tensors;
    tensors.reserve(entries.size());
    for (const TensorEntry& entry : entries) {
      torch::Tensor t = torch::empty(entry.shape, entry.type);
      const uint64_t span = entry.end - entry.begin;
      TALLY_ASSIGN_OR_RETURN(
          uint64_t read, ReadAt(fd.get(), data_start + entry.begin,
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
