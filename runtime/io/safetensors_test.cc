#include "runtime/io/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <ostream>
#include <string>
#include <vector>

namespace tally {
namespace {

namespace fs = std::filesystem;

using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (fs::path(::testing::TempDir()) / "safetensors_test_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string PathOf(const std::string& name) const {
    return (fs::path(dir_) / name).string();
  }

  std::string dir_;
};

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// The memory of a tensor, for bitwise comparison whatever the dtype (NaN
// included).
std::string BytesOf(const torch::Tensor& t) {
  torch::Tensor c = t.contiguous();
  if (c.numel() == 0) return "";
  return std::string(static_cast<const char*>(c.data_ptr()),
                     c.numel() * c.element_size());
}

// A safetensors file assembled here, independently of the writer: the
// little-endian length prefix, `header` as given, then `data`.
std::string AssembleFile(const std::string& header, const std::string& data) {
  std::string file;
  uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) {
    file += static_cast<char>(length & 0xff);
    length >>= 8;
  }
  return file + header + data;
}

// A tensor with varied values (special floats included) of `dtype`.
torch::Tensor Sample(torch::ScalarType dtype, std::vector<int64_t> shape) {
  torch::manual_seed(static_cast<uint64_t>(dtype) + 1);
  if (!torch::isFloatingType(dtype)) {
    const int64_t bound = dtype == torch::kInt64 ? int64_t{1} << 40 : 1 << 30;
    return torch::randint(-bound, bound, shape, dtype);
  }
  torch::Tensor t = torch::randn(shape, torch::kFloat64).to(dtype);
  if (t.numel() >= 4) {
    t.view(-1)[0] = std::numeric_limits<double>::infinity();
    t.view(-1)[1] = std::numeric_limits<double>::quiet_NaN();
    t.view(-1)[2] = -0.0;
  }
  return t;
}

class SafetensorsDtypeTest
    : public SafetensorsTest,
      public ::testing::WithParamInterface<torch::ScalarType> {};

TEST_P(SafetensorsDtypeTest, RoundTripsBitwiseInOrder) {
  const torch::ScalarType dtype = GetParam();
  const torch::Tensor matrix = Sample(dtype, {3, 5});
  const NamedTensors written = {{"matrix", matrix},
                                {"scalar", Sample(dtype, {})},
                                {"empty", Sample(dtype, {0})},
                                {"empty_3d", Sample(dtype, {2, 0, 3})},
                                {"transposed", matrix.t()},  // not contiguous
                                {"row", Sample(dtype, {7})}};
  const std::string path = PathOf("t.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, written).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  absl::StatusOr<NamedTensors> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), written.size());
  uint64_t expected_data_bytes = 0;
  for (size_t i = 0; i < written.size(); ++i) {
    const auto& [name, expected] = written[i];
    const torch::Tensor& actual = (*read)[i].second;
    SCOPED_TRACE(name);
    EXPECT_EQ((*read)[i].first, name);
    EXPECT_EQ(actual.scalar_type(), dtype);
    EXPECT_EQ(actual.sizes(), expected.sizes());
    EXPECT_TRUE(actual.is_contiguous());
    EXPECT_EQ(BytesOf(actual), BytesOf(expected));
    if (expected.numel() > 0) {
      EXPECT_NE(actual.data_ptr(), expected.data_ptr());
    }
    expected_data_bytes += expected.numel() * expected.element_size();
  }
  // Prefix, an 8-aligned header, then exactly the tensor bytes.
  const std::string file = ReadBytes(path);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) {
    header_size = (header_size << 8) | static_cast<unsigned char>(file[i]);
  }
  EXPECT_EQ(header_size % 8, 0u);
  EXPECT_EQ(file.size(), 8 + header_size + expected_data_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypes, SafetensorsDtypeTest,
    ::testing::Values(torch::kFloat32, torch::kFloat64, torch::kFloat16,
                      torch::kBFloat16, torch::kInt64, torch::kInt32),
    [](const ::testing::TestParamInfo<torch::ScalarType>& info) {
      return std::string(c10::toString(info.param));
    });

TEST_F(SafetensorsTest, MetadataRoundTrips) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"note", "quotes \" and \\ and \xc3\xa9"}};
  const std::string path = PathOf("m.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"x", torch::ones({2})}}, metadata).ok());
  std::map<std::string, std::string> read_metadata;
  ASSERT_TRUE(ReadSafetensors(path, &read_metadata).ok());
  EXPECT_EQ(read_metadata, metadata);
}

TEST_F(SafetensorsTest, NoTensorsAndNoMetadataRoundTrip) {
  const std::string path = PathOf("empty.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {}).ok());
  std::map<std::string, std::string> metadata = {{"stale", "entry"}};
  absl::StatusOr<NamedTensors> read = ReadSafetensors(path, &metadata);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(read->empty());
  EXPECT_EQ(metadata.count("format"), 0u);
  // "{}" padded to 8 bytes.
  EXPECT_EQ(ReadBytes(path), AssembleFile("{}      ", ""));
}

TEST_F(SafetensorsTest, WritesTheReferenceByteLayout) {
  const std::string path = PathOf("tiny.safetensors");
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"a", torch::tensor({1.0f, -2.0f})},
                                {"b", torch::tensor(7, torch::kInt32)}},
                               {{"format", "pt"}})
                  .ok());
  // 138 bytes of JSON + 6 spaces = 144 = 0x90; a: 2 x F32 = bytes [0, 8);
  // b: one I32 = bytes [8, 12).
  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"I32","shape":[],"data_offsets":[8,12]}})"
      "      ";
  const std::string expected = std::string("\x90\0\0\0\0\0\0\0", 8) + header +
                               std::string(
                                   "\x00\x00\x80\x3f"   // 1.0f
                                   "\x00\x00\x00\xc0"   // -2.0f
                                   "\x07\x00\x00\x00",  // 7
                                   12);
  EXPECT_EQ(header.size(), 144u);
  EXPECT_EQ(ReadBytes(path), expected);
}

TEST_F(SafetensorsTest, ReadsUnpaddedHeaderInOffsetOrder) {
  // Another writer: no padding, keys not in data order, an empty tensor.
  const std::string path = PathOf("foreign.safetensors");
  WriteBytes(path,
             AssembleFile(R"({"late":{"dtype":"I64","shape":[1],)"
                          R"("data_offsets":[4,12]},)"
                          R"("none":{"dtype":"F64","shape":[0,4],)"
                          R"("data_offsets":[4,4]},)"
                          R"("early":{"dtype":"F32","shape":[],)"
                          R"("data_offsets":[0,4]}})",
                          std::string("\x00\x00\x40\x40"  // 3.0f
                                      "\xff\xff\xff\xff\xff\xff\xff\xff",  // -1
                                      12)));
  absl::StatusOr<NamedTensors> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 3u);
  EXPECT_EQ((*read)[0].first, "early");
  EXPECT_EQ((*read)[0].second.item<float>(), 3.0f);
  EXPECT_EQ((*read)[1].first, "none");
  EXPECT_EQ((*read)[1].second.sizes(), torch::IntArrayRef({0, 4}));
  EXPECT_EQ((*read)[2].first, "late");
  EXPECT_EQ((*read)[2].second.scalar_type(), torch::kInt64);
  EXPECT_EQ((*read)[2].second.item<int64_t>(), -1);
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  const absl::StatusOr<NamedTensors> read =
      ReadSafetensors(PathOf("absent.safetensors"));
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(read.status().message()),
              HasSubstr("absent.safetensors"));
}

// A screen sees every tensor of the header before the first is allocated:
// a 64 GiB tensor it skips is never allocated nor read, and a refusal of the
// last tensor returns before any is read, naming the file.
TEST_F(SafetensorsTest, ScreenDecidesBeforeAnythingIsAllocated) {
  const std::string path = PathOf("screened.safetensors");
  const uint64_t huge = uint64_t{64} << 30;
  const std::string header = EncodeSafetensorsHeader(
      {{"small", SafetensorsDType::kF32, {1}, 0, 4},
       {"huge", SafetensorsDType::kF32, {int64_t{1} << 24, 1024}, 4, 4 + huge},
       {"last", SafetensorsDType::kF32, {0}, 4 + huge, 4 + huge}},
      {});
  const float one = 1.0f;
  WriteBytes(path, header + std::string(reinterpret_cast<const char*>(&one),
                                        sizeof(one)));
  ASSERT_EQ(
      ::truncate(path.c_str(), static_cast<off_t>(header.size() + 4 + huge)),
      0);

  std::vector<std::string> seen;
  auto skip_huge =
      [&](const SafetensorsEntry& entry) -> absl::StatusOr<ScreenVerdict> {
    seen.push_back(entry.name);
    return entry.name == "huge" ? ScreenVerdict::kSkip : ScreenVerdict::kRead;
  };
  absl::StatusOr<NamedTensors> read = ReadSafetensors(path, nullptr, skip_huge);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(seen, (std::vector<std::string>{"small", "huge", "last"}));
  ASSERT_EQ(read->size(), 2u);
  EXPECT_EQ((*read)[0].first, "small");
  EXPECT_TRUE(torch::equal((*read)[0].second, torch::ones({1})));
  EXPECT_EQ((*read)[1].first, "last");

  auto refuse_last =
      [](const SafetensorsEntry& entry) -> absl::StatusOr<ScreenVerdict> {
    if (entry.name == "last") {
      return absl::InvalidArgumentError("tensor last is unwanted");
    }
    return ScreenVerdict::kRead;  // "huge" too: refused before it is read
  };
  const absl::Status status =
      ReadSafetensors(path, nullptr, refuse_last).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), path + ": tensor last is unwanted");
}

TEST_F(SafetensorsTest, CorruptHeaderLengthIsDataLoss) {
  const std::string path = PathOf("c.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"x", torch::ones({4})}}).ok());
  const std::string good = ReadBytes(path);
  for (uint64_t bad_length :
       {static_cast<uint64_t>(good.size()),  // runs past the end
        uint64_t{1} << 62, uint64_t{0}}) {
    SCOPED_TRACE(bad_length);
    std::string file = good;
    for (int i = 0; i < 8; ++i) {
      file[i] = static_cast<char>((bad_length >> (8 * i)) & 0xff);
    }
    WriteBytes(path, file);
    const absl::Status status = ReadSafetensors(path).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(status.message()), HasSubstr(path));
  }
  WriteBytes(path, good.substr(0, 5));
  EXPECT_EQ(ReadSafetensors(path).status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(SafetensorsTest, TruncatedFileIsDataLossNamingTheTensor) {
  const std::string path = PathOf("t.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"first", torch::ones({4})},
                                      {"second", torch::ones({4})}})
                  .ok());
  const std::string good = ReadBytes(path);
  WriteBytes(path, good.substr(0, good.size() - 3));
  const absl::Status status = ReadSafetensors(path).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr(path));
  EXPECT_THAT(std::string(status.message()), HasSubstr("\"second\""));
}

struct MalformedCase {
  std::string label;
  std::string header;
  size_t data_bytes;
  std::string message;  // expected in the error
};

void PrintTo(const MalformedCase& c, std::ostream* os) { *os << c.label; }

class SafetensorsMalformedTest
    : public SafetensorsTest,
      public ::testing::WithParamInterface<MalformedCase> {};

TEST_P(SafetensorsMalformedTest, IsDataLoss) {
  const MalformedCase& c = GetParam();
  const std::string path = PathOf("bad.safetensors");
  WriteBytes(path, AssembleFile(c.header, std::string(c.data_bytes, '\0')));
  const absl::Status status = ReadSafetensors(path).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(path));
  EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
}

INSTANTIATE_TEST_SUITE_P(
    Headers, SafetensorsMalformedTest,
    ::testing::Values(
        MalformedCase{"BadJson", R"({"a": {"dtype": )", 0, "JSON"},
        MalformedCase{"NotAnObject", "[1, 2]", 0, "JSON object"},
        MalformedCase{
            "Overlap",
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            12, "\"b\": data_offsets [4, 12] overlap tensor \"a\""},
        MalformedCase{
            "Gap",
            R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
            12, "\"b\""},
        MalformedCase{
            "TrailingBytes",
            R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8,
            "\"a\""},
        MalformedCase{
            "OutOfRange",
            R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8,
            "\"a\""},
        MalformedCase{
            "ShapeSpanMismatch",
            R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8,
            "\"a\""},
        MalformedCase{
            "UnknownDtype",
            R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,1]}})", 1,
            "\"a\": unknown dtype \"Q4\""},
        MalformedCase{
            "NegativeDimension",
            R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4,
            "\"a\""},
        MalformedCase{"HugeShape",
                      R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],)"
                      R"("data_offsets":[0,0]}})",
                      0, "\"a\""},
        MalformedCase{"OffsetsNotAPair",
                      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})",
                      4, "\"a\""},
        MalformedCase{"MetadataNotString", R"({"__metadata__":{"k":1}})", 0,
                      "__metadata__"}),
    [](const ::testing::TestParamInfo<MalformedCase>& info) {
      return info.param.label;
    });

TEST_F(SafetensorsTest, RejectsUnwritableTensors) {
  const std::string path = PathOf("w.safetensors");
  absl::Status status =
      WriteSafetensors(path, {{"flags", torch::ones({2}, torch::kBool)}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("\"flags\""));

  status = WriteSafetensors(path,
                            {{"x", torch::ones({1})}, {"x", torch::ones({1})}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("\"x\""));

  status = WriteSafetensors(path, {{"__metadata__", torch::ones({1})}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(path));

  status = WriteSafetensors(PathOf("no/such/dir/w.safetensors"),
                            {{"x", torch::ones({1})}});
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, OverwritesAnExistingFile) {
  const std::string path = PathOf("o.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"old", torch::ones({1000})}}).ok());
  ASSERT_TRUE(WriteSafetensors(path, {{"new", torch::full({2}, 5.0)}}).ok());
  absl::StatusOr<NamedTensors> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u);
  EXPECT_EQ((*read)[0].first, "new");
  EXPECT_TRUE(torch::equal((*read)[0].second, torch::full({2}, 5.0)));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

}  // namespace
}  // namespace tally
