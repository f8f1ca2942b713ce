// base/log: the text line and --log-format json's objects, parsed back, with
// the rank and the model and request a thread's LogContext names.
#include "base/log.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace tally {
namespace {

const absl::Time kTime = absl::FromUnixMillis(1'700'000'000'123);

class LogTest : public ::testing::Test {
 protected:
  ~LogTest() override {
    SetLogFormat(LogFormat::kText);
    SetLogRank(-1);
  }

  // The line as JSON; fails the test unless it is one object and a newline.
  static nlohmann::json JsonLine(LogLevel level, absl::string_view message) {
    const std::string line = FormatLogLine(level, message, kTime);
    EXPECT_EQ(line.find('\n'), line.size() - 1) << line;
    return nlohmann::json::parse(line);
  }
};

TEST_F(LogTest, ParsesTheFormatFlag) {
  EXPECT_EQ(*ParseLogFormat("text"), LogFormat::kText);
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  const absl::Status bad = ParseLogFormat("yaml").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(), "log format must be text or json, got 'yaml'");
}

TEST_F(LogTest, TextLinesKeepTheirFormat) {
  const std::string line =
      FormatLogLine(LogLevel::kWarning, "disk is slow", kTime);
  EXPECT_EQ(line, absl::StrCat("W2023-11-14T22:13:20.123Z ", getpid(),
                               "] disk is slow\n"));
}

TEST_F(LogTest, JsonLinesCarryEveryField) {
  SetLogFormat(LogFormat::kJson);
  nlohmann::json line = JsonLine(LogLevel::kInfo, "serving");
  EXPECT_EQ(line, nlohmann::json::parse(R"({"time": "2023-11-14T22:13:20.123Z",
              "level": "info", "rank": null, "model": null,
              "request_id": null, "message": "serving"})"));

  SetLogRank(3);
  {
    const LogContext request("tenant/m", "17");
    line = JsonLine(LogLevel::kError, "a command threw: \"x\"\n\tat y");
    EXPECT_EQ(line["rank"], 3);
    EXPECT_EQ(line["level"], "error");
    EXPECT_EQ(line["model"], "tenant/m");
    EXPECT_EQ(line["request_id"], "17");
    EXPECT_EQ(line["message"], "a command threw: \"x\"\n\tat y");
    {
      const LogContext unsequenced("other", "");  // nests
      line = JsonLine(LogLevel::kDebug, "inner");
      EXPECT_EQ(line["model"], "other");
      EXPECT_TRUE(line["request_id"].is_null());
    }
    EXPECT_EQ(JsonLine(LogLevel::kWarning, "outer")["model"], "tenant/m");
    // The context is the thread's own.
    std::thread([] {
      EXPECT_TRUE(JsonLine(LogLevel::kInfo, "elsewhere")["model"].is_null());
    }).join();
  }
  EXPECT_TRUE(JsonLine(LogLevel::kInfo, "after")["model"].is_null());
}

TEST_F(LogTest, InvalidUtf8StillMakesAJsonLine) {
  SetLogFormat(LogFormat::kJson);
  const nlohmann::json line = JsonLine(LogLevel::kInfo, "bad \xff byte");
  EXPECT_EQ(line["message"], "bad \xEF\xBF\xBD byte");
}

}  // namespace
}  // namespace tally
