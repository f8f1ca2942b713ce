#include "runtime/io/safetensors_header.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>
#include <variant>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/json_reader.h"
#include "base/status.h"

namespace tally {
namespace {

using Json = nlohmann::ordered_json;

struct DTypeInfo {
  SafetensorsDType dtype;
  const char* code;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {SafetensorsDType::kF32, "F32", 4}, {SafetensorsDType::kF64, "F64", 8},
    {SafetensorsDType::kF16, "F16", 2}, {SafetensorsDType::kBF16, "BF16", 2},
    {SafetensorsDType::kI64, "I64", 8}, {SafetensorsDType::kI32, "I32", 4}};

const DTypeInfo& InfoOf(SafetensorsDType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // unreachable: every enumerator is in kDTypes
}

// A valid header nests three levels deep (header, entry, shape); the limit
// leaves room for metadata a newer writer may nest.
constexpr JsonLimits kHeaderJsonLimits = {kSafetensorsMaxHeaderBytes, 16};

// Validates one header entry against a data buffer of `data_size` bytes.
// Returns the reason it is malformed, or the parsed entry.
std::variant<std::string, SafetensorsEntry> ParseEntry(const std::string& name,
                                                       const Json& value,
                                                       uint64_t data_size) {
  if (!value.is_object()) return std::string("entry is not a JSON object");
  SafetensorsEntry entry;
  entry.name = name;

  const auto dtype = value.find("dtype");
  if (dtype == value.end() || !dtype->is_string()) {
    return std::string("dtype is missing or not a string");
  }
  const std::optional<SafetensorsDType> type =
      SafetensorsDTypeFromCode(dtype->get_ref<const std::string&>());
  if (!type) return absl::StrCat("unknown dtype ", JsonExcerpt(*dtype));
  entry.dtype = *type;

  const auto shape = value.find("shape");
  if (shape == value.end() || !shape->is_array()) {
    return std::string("shape is missing or not an array");
  }
  // Element count, saturating so an absurd shape cannot wrap around.
  constexpr uint64_t kMax = std::numeric_limits<int64_t>::max();
  uint64_t numel = 1;
  for (const Json& dim : *shape) {
    if (!dim.is_number_unsigned() || dim.get<uint64_t>() > kMax) {
      return absl::StrCat("shape element ", entry.shape.size(), " (",
                          JsonExcerpt(dim), ") is not a dimension");
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
  const uint64_t itemsize = SafetensorsDTypeSize(entry.dtype);
  const uint64_t span = entry.end - entry.begin;
  if (numel > kMax / itemsize || numel * itemsize != span) {
    return absl::StrCat("shape ", JsonExcerpt(*shape), " of dtype ",
                        dtype->get_ref<const std::string&>(),
                        " does not fill its ", span, "-byte data_offsets span");
  }
  return entry;
}

absl::Status ParseMetadata(const Json& value,
                           std::map<std::string, std::string>& metadata) {
  if (!value.is_object()) {
    return absl::DataLossError("__metadata__ is not an object");
  }
  for (const auto& [key, text] : value.items()) {
    if (!text.is_string()) {
      return absl::DataLossError(
          absl::StrCat("__metadata__ \"", key, "\" is not a string"));
    }
    metadata[key] = text.get<std::string>();
  }
  return absl::OkStatus();
}

// Sorts `entries` into data layout order and checks that they tile the
// `data_size`-byte data buffer exactly.
absl::Status CheckTiling(std::vector<SafetensorsEntry>& entries,
                         uint64_t data_size) {
  std::stable_sort(entries.begin(), entries.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
                   });
  uint64_t cursor = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& entry : entries) {
    if (entry.begin < cursor) {
      return absl::DataLossError(absl::StrCat(
          "tensor \"", entry.name, "\": data_offsets [", entry.begin, ", ",
          entry.end, "] overlap tensor \"", previous->name, "\""));
    }
    if (entry.begin > cursor) {
      return absl::DataLossError(
          absl::StrCat("tensor \"", entry.name, "\": data_offsets [",
                       entry.begin, ", ", entry.end, "] leave bytes [", cursor,
                       ", ", entry.begin, ") of the data buffer unused"));
    }
    cursor = entry.end;
    previous = &entry;
  }
  if (cursor != data_size) {
    return absl::DataLossError(absl::StrCat(
        "the data buffer holds ", data_size, " bytes but its tensors",
        previous ? absl::StrCat(" (last: \"", previous->name, "\")")
                 : std::string(),
        " cover only ", cursor));
  }
  return absl::OkStatus();
}

}  // namespace

const char* SafetensorsDTypeCode(SafetensorsDType dtype) {
  return InfoOf(dtype).code;
}

std::optional<SafetensorsDType> SafetensorsDTypeFromCode(
    absl::string_view code) {
  for (const DTypeInfo& info : kDTypes) {
    if (code == info.code) return info.dtype;
  }
  return std::nullopt;
}

size_t SafetensorsDTypeSize(SafetensorsDType dtype) {
  return InfoOf(dtype).size;
}

bool SafetensorsEntry::operator==(const SafetensorsEntry& other) const {
  return name == other.name && dtype == other.dtype && shape == other.shape &&
         begin == other.begin && end == other.end;
}

absl::StatusOr<uint64_t> ParseSafetensorsHeaderLength(absl::string_view prefix,
                                                      uint64_t file_size) {
  if (prefix.size() < kSafetensorsLengthBytes ||
      file_size < kSafetensorsLengthBytes) {
    return absl::DataLossError(
        absl::StrCat("file of ", file_size, " bytes is too short for the ",
                     kSafetensorsLengthBytes, "-byte header length"));
  }
  uint64_t header_size = 0;
  for (size_t i = 0; i < kSafetensorsLengthBytes; ++i) {
    header_size |= uint64_t{static_cast<unsigned char>(prefix[i])} << (8 * i);
  }
  if (header_size > kSafetensorsMaxHeaderBytes ||
      header_size > file_size - kSafetensorsLengthBytes) {
    return absl::DataLossError(absl::StrCat("header length ", header_size,
                                            " does not fit the ", file_size,
                                            "-byte file"));
  }
  return header_size;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view text,
                                                         uint64_t file_size) {
  SafetensorsHeader header;
  header.data_start = kSafetensorsLengthBytes + text.size();
  if (text.size() > kSafetensorsMaxHeaderBytes ||
      file_size < header.data_start) {
    return absl::DataLossError(absl::StrCat("header length ", text.size(),
                                            " does not fit the ", file_size,
                                            "-byte file"));
  }
  header.data_size = file_size - header.data_start;
  // Ordered, so tensors sharing an offset (empty ones) keep header order.
  TALLY_ASSIGN_OR_RETURN(const Json json,
                         ParseJson<Json>(text, kHeaderJsonLimits, "header",
                                         absl::StatusCode::kDataLoss));
  if (!json.is_object()) {
    return absl::DataLossError("header is not a JSON object");
  }
  for (const auto& [name, value] : json.items()) {
    if (name == "__metadata__") {
      TALLY_RETURN_IF_ERROR(ParseMetadata(value, header.metadata));
      continue;
    }
    auto parsed = ParseEntry(name, value, header.data_size);
    if (auto* why = std::get_if<std::string>(&parsed)) {
      return absl::DataLossError(absl::StrCat("tensor \"", name, "\": ", *why));
    }
    header.tensors.push_back(std::get<SafetensorsEntry>(std::move(parsed)));
  }
  TALLY_RETURN_IF_ERROR(CheckTiling(header.tensors, header.data_size));
  return header;
}

std::string EncodeSafetensorsHeader(
    const std::vector<SafetensorsEntry>& tensors,
    const std::map<std::string, std::string>& metadata) {
  // Built by hand rather than as one ordered_json, whose key lookup is linear
  // per insert.
  std::string header = "{";
  auto append_entry = [&](const std::string& key, const Json& value) {
    if (header.size() > 1) header += ',';
    header += Json(key).dump();
    header += ':';
    header += value.dump();
  };
  if (!metadata.empty()) append_entry("__metadata__", metadata);
  for (const SafetensorsEntry& tensor : tensors) {
    Json entry;
    entry["dtype"] = SafetensorsDTypeCode(tensor.dtype);
    entry["shape"] = tensor.shape;
    entry["data_offsets"] = {tensor.begin, tensor.end};
    append_entry(tensor.name, entry);
  }
  header += '}';
  // Spaces are JSON whitespace; they align the data start to 8 bytes.
  header.append((8 - header.size() % 8) % 8, ' ');

  std::string out;
  out.reserve(kSafetensorsLengthBytes + header.size());
  for (size_t i = 0; i < kSafetensorsLengthBytes; ++i) {
    out += static_cast<char>((static_cast<uint64_t>(header.size()) >> (8 * i)) &
                             0xff);
  }
  out += header;
  return out;
}

}  // namespace tally
