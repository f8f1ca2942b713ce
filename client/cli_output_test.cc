// client/output.h (tallyctl's --output) and the command-line errors of
// client/command_line.h that make tallyctl exit 2.
#include <cmath>
#include <sstream>
#include <string>

#include "client/command_line.h"
#include "client/output.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tally/v1/trainer.pb.h"

namespace tally {
namespace {

using ::testing::HasSubstr;

TEST(CliOutputTest, FormatIsTextOrJsonAndAnythingElseIsAFlagError) {
  EXPECT_EQ(Output::FormatNamed("text").value(), Output::Format::kText);
  EXPECT_EQ(Output::FormatNamed("json").value(), Output::Format::kJson);
  for (const char* name : {"JSON", "yaml", ""}) {
    const absl::StatusOr<Output::Format> format = Output::FormatNamed(name);
    ASSERT_FALSE(format.ok()) << name;
    EXPECT_TRUE(IsFlagError(format.status()));
    EXPECT_THAT(std::string(format.status().message()),
                HasSubstr("flag --output: '" + std::string(name) +
                          "' is not text or json"));
  }
}

TEST(CliOutputTest, TextRunsThePrinterAndPrintsTheRecordText) {
  std::ostringstream out;
  Output output(Output::Format::kText, out);
  v1::ModelInfo info;
  info.set_model_id("m");
  ASSERT_TRUE(
      output.Print(info, [](std::ostream& os) { os << "model m\n"; }).ok());
  output.Print(nlohmann::ordered_json{{"step", 1}}, "step 1\n");
  EXPECT_EQ(out.str(), "model m\nstep 1\n");
}

TEST(CliOutputTest, JsonPrintsOneLinePerResultWithProtoNamesAndZeros) {
  std::ostringstream out;
  Output output(Output::Format::kJson, out);
  v1::ModelInfo info;
  info.set_model_id("m");
  info.set_dtype(v1::DTYPE_BFLOAT16);
  info.set_num_parameters(12345678901);
  bool text_printed = false;
  ASSERT_TRUE(
      output.Print(info, [&](std::ostream&) { text_printed = true; }).ok());
  EXPECT_FALSE(text_printed);
  output.Print(nlohmann::ordered_json{{"step", 2}, {"loss", std::nan("")}},
               "not printed\n");

  std::istringstream lines(out.str());
  std::string line;
  ASSERT_TRUE(std::getline(lines, line));
  const nlohmann::json message = nlohmann::json::parse(line);
  EXPECT_EQ(message["model_id"], "m");
  EXPECT_EQ(message["dtype"], "DTYPE_BFLOAT16");
  EXPECT_EQ(message["num_parameters"], "12345678901");  // int64: a string
  EXPECT_EQ(message["step"], "0");                      // zeros printed
  EXPECT_EQ(message["default_max_grad_norm"], 0);
  ASSERT_TRUE(std::getline(lines, line));
  EXPECT_EQ(line, R"({"step":2,"loss":null})");  // in order; NaN is null
  EXPECT_FALSE(std::getline(lines, line));
}

TEST(CliOutputTest, FlagErrorsAreMarkedAndOtherErrorsAreNot) {
  const absl::Status value = FlagValueError("dtype", "int8", "float32");
  EXPECT_EQ(value.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(value.message(), "flag --dtype: 'int8' is not float32");
  EXPECT_TRUE(IsFlagError(value));
  EXPECT_TRUE(IsFlagError(FlagError("flags --a and --b go together")));
  // A server's INVALID_ARGUMENT (exit 1) is not one.
  EXPECT_FALSE(IsFlagError(absl::InvalidArgumentError("bad request")));
  EXPECT_FALSE(IsFlagError(absl::OkStatus()));

  int steps = 0;
  FlagParser parser("tallyctl train", {"MODEL"}, "Trains.");
  parser.Add("steps", &steps, "steps");
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"m", "--steps", "x"}, {"m", "--nope"}, {"m", "--steps"}, {}}) {
    const auto parsed = parser.Parse(args);
    ASSERT_FALSE(parsed.ok());
    EXPECT_TRUE(IsFlagError(parsed.status())) << parsed.status();
  }
}

}  // namespace
}  // namespace tally
