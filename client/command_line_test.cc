#include "client/command_line.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tally {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The flags of a train-like command, bound to fresh defaults.
struct TrainFlags {
  std::string text = "corpus.txt";
  int steps = 30;
  int64_t big = 0;
  uint64_t seed = 0;
  double zero_prob = 0.0;
  std::optional<double> lr;
  bool no_optimizer = false;
  FlagParser parser{"tallyctl train", {"MODEL"}, "Trains MODEL."};

  TrainFlags() {
    parser.Add("text", &text, "training text");
    parser.Add("steps", &steps, "optimizer steps");
    parser.Add("big", &big, "a 64-bit count");
    parser.Add("seed", &seed, "data seed");
    parser.Add("zero-prob", &zero_prob, "zero-weight chance");
    parser.Add("lr", &lr, "learning rate");
    parser.Add("no-optimizer", &no_optimizer, "weights only");
  }
};

TEST(FlagParserTest, AssignsSpaceAndEqualsFormsAndReturnsPositionals) {
  TrainFlags f;
  auto positional = f.parser.Parse(
      {"--steps", "5", "demo", "--lr=0.25", "--seed", "18446744073709551615",
       "--big=-9000000000", "--zero-prob", "1e-2", "--text=a=b.txt"});
  ASSERT_TRUE(positional.ok()) << positional.status();
  EXPECT_THAT(*positional, ElementsAre("demo"));
  EXPECT_EQ(f.steps, 5);
  EXPECT_EQ(f.lr, 0.25);
  EXPECT_EQ(f.seed, UINT64_MAX);
  EXPECT_EQ(f.big, -9000000000LL);
  EXPECT_DOUBLE_EQ(f.zero_prob, 0.01);
  EXPECT_EQ(f.text, "a=b.txt");  // only the first '=' splits
  EXPECT_FALSE(f.parser.help_requested());
}

TEST(FlagParserTest, UntouchedFlagsKeepTheirDefaults) {
  TrainFlags f;
  ASSERT_TRUE(f.parser.Parse({"demo"}).ok());
  EXPECT_EQ(f.steps, 30);
  EXPECT_EQ(f.text, "corpus.txt");
  EXPECT_FALSE(f.lr.has_value());
  EXPECT_FALSE(f.no_optimizer);
}

TEST(FlagParserTest, BoolFlagsTakeNoValueUnlessGivenWithEquals) {
  TrainFlags f;
  ASSERT_TRUE(f.parser.Parse({"--no-optimizer", "demo"}).ok());
  EXPECT_TRUE(f.no_optimizer);

  TrainFlags g;
  ASSERT_TRUE(g.parser.Parse({"demo", "--no-optimizer=false"}).ok());
  EXPECT_FALSE(g.no_optimizer);
}

TEST(FlagParserTest, DoubleDashEndsFlags) {
  TrainFlags f;
  f.parser = FlagParser("tallyctl save", {"MODEL", "PATH"}, "Saves.");
  auto positional = f.parser.Parse({"--", "demo", "--weird-path"});
  ASSERT_TRUE(positional.ok()) << positional.status();
  EXPECT_THAT(*positional, ElementsAre("demo", "--weird-path"));
}

TEST(FlagParserTest, ErrorsNameTheOffendingFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"demo", "--stepz", "3"}, "unknown flag --stepz"},
      {{"demo", "-s"}, "unknown flag -s"},
      {{"demo", "--steps"}, "flag --steps needs a value"},
      {{"demo", "--steps", "three"}, "flag --steps: 'three' is not an integer"},
      {{"demo", "--steps", "99999999999"}, "flag --steps"},
      {{"demo", "--seed", "-1"}, "flag --seed: '-1' is not a non-negative"},
      {{"demo", "--lr", "fast"}, "flag --lr: 'fast' is not a number"},
      {{"demo", "--no-optimizer=maybe"}, "flag --no-optimizer"},
      {{}, "expected 1 argument(s) (MODEL), got 0"},
      {{"a", "b"}, "expected 1 argument(s) (MODEL), got 2 (a b)"},
  };
  for (const Case& c : cases) {
    TrainFlags f;
    auto result = f.parser.Parse(c.args);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument)
        << c.expected;
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(c.expected));
  }
}

TEST(FlagParserTest, HelpStopsParsingAndListsFlagsWithDefaults) {
  TrainFlags f;
  f.lr = 0.5;
  f.parser.Add("lr2", &f.lr, "a flag added with a value");
  // Missing MODEL and a bad value after --help are not reported.
  auto result = f.parser.Parse({"--help", "--steps", "x"});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(f.parser.help_requested());
  EXPECT_EQ(f.steps, 30);

  const std::string help = f.parser.Help();
  EXPECT_THAT(help, HasSubstr("usage: tallyctl train MODEL [flags]"));
  EXPECT_THAT(help, HasSubstr("Trains MODEL."));
  EXPECT_THAT(help, HasSubstr("--steps N"));
  EXPECT_THAT(help, HasSubstr("optimizer steps (default: 30)"));
  EXPECT_THAT(help, HasSubstr("--text STR"));
  EXPECT_THAT(help, HasSubstr("(default: corpus.txt)"));
  EXPECT_THAT(help, HasSubstr("--lr X"));
  EXPECT_THAT(help, HasSubstr("a flag added with a value (default: 0.5)"));
  EXPECT_THAT(help, HasSubstr("-h, --help"));
  // Absent optional and false bool defaults are not shown.
  EXPECT_THAT(help, HasSubstr("learning rate\n"));
  EXPECT_THAT(help, HasSubstr("weights only\n"));

  TrainFlags g;
  ASSERT_TRUE(g.parser.Parse({"demo", "-h"}).ok());
  EXPECT_TRUE(g.parser.help_requested());
}

}  // namespace
}  // namespace tally
