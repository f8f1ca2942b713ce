// BasicCredentials (--metrics-auth-file): one "<user>:<password>" line,
// matched exactly, and a malformed file refused without echoing the secret.
#include <string>

#include "gtest/gtest.h"
#include "server/auth.h"

namespace tally {
namespace {

TEST(BasicCredentialsTest, MatchesOnlyTheExactUserAndPassword) {
  const absl::StatusOr<BasicCredentials> scraper =
      BasicCredentials::FromText("prometheus:s3cr:et\n", "metrics-auth");
  ASSERT_TRUE(scraper.ok()) << scraper.status();
  // The user ends at the first colon; the password may hold more.
  EXPECT_TRUE(scraper->Matches("prometheus", "s3cr:et"));
  EXPECT_FALSE(scraper->Matches("prometheus", "s3cr"));
  EXPECT_FALSE(scraper->Matches("prometheus", "s3cr:et "));
  EXPECT_FALSE(scraper->Matches("Prometheus", "s3cr:et"));
  EXPECT_FALSE(scraper->Matches("prometheus:s3cr", "et"));
  EXPECT_FALSE(scraper->Matches("", ""));
}

TEST(BasicCredentialsTest, RefusesAnythingButOneUserPasswordLine) {
  for (const std::string& text :
       {std::string(""), std::string("no-colon-secret"),
        std::string(":password-only"), std::string("user-only:"),
        std::string("a:b\nc:d")}) {
    const absl::StatusOr<BasicCredentials> refused =
        BasicCredentials::FromText(text, "metrics-auth");
    ASSERT_FALSE(refused.ok()) << text;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("metrics-auth: expected"),
              std::string::npos)
        << refused.status();
    EXPECT_EQ(refused.status().message().find("secret"), std::string::npos)
        << "the file's content was echoed: " << refused.status();
  }
  EXPECT_FALSE(BasicCredentials::FromFile("/nonexistent/metrics-auth").ok());
}

}  // namespace
}  // namespace tally
