#include "client/command_line.h"

#include <algorithm>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace tally {
namespace {

// The payload that marks a FlagError (its value is unused).
constexpr char kFlagErrorPayload[] = "tally.dev/command-line-error";

// Breaks `text` into lines of at most `width` characters at spaces.
std::string WrapWords(const std::string& text, size_t width) {
  std::string wrapped;
  size_t line_length = 0;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (line_length > 0 && line_length + 1 + word.size() > width) {
      wrapped += '\n';
      line_length = 0;
    } else if (line_length > 0) {
      wrapped += ' ';
      ++line_length;
    }
    absl::StrAppend(&wrapped, word);
    line_length += word.size();
  }
  return wrapped;
}

}  // namespace

absl::Status FlagError(absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kFlagErrorPayload, absl::Cord());
  return status;
}

absl::Status FlagValueError(absl::string_view flag, absl::string_view value,
                            absl::string_view expected) {
  return FlagError(
      absl::StrCat("flag --", flag, ": '", value, "' is not ", expected));
}

bool IsFlagError(const absl::Status& status) {
  return status.GetPayload(kFlagErrorPayload).has_value();
}

FlagParser::FlagParser(std::string usage, std::vector<std::string> positional,
                       std::string description)
    : usage_(std::move(usage)),
      positional_(std::move(positional)),
      description_(std::move(description)) {}

void FlagParser::Add(const std::string& name, std::string* value,
                     std::string help) {
  AddFlag(name, value, std::move(help));
}
void FlagParser::Add(const std::string& name, int* value, std::string help) {
  AddFlag(name, value, std::move(help));
}
void FlagParser::Add(const std::string& name, int64_t* value,
                     std::string help) {
  AddFlag(name, value, std::move(help));
}
void FlagParser::Add(const std::string& name, uint64_t* value,
                     std::string help) {
  AddFlag(name, value, std::move(help));
}
void FlagParser::Add(const std::string& name, double* value, std::string help) {
  AddFlag(name, value, std::move(help));
}
void FlagParser::Add(const std::string& name, std::optional<double>* value,
                     std::string help) {
  AddFlag(name, value, std::move(help));
}
void FlagParser::Add(const std::string& name, bool* value, std::string help) {
  AddFlag(name, value, std::move(help));
}

void FlagParser::AddFlag(const std::string& name, Target target,
                         std::string help) {
  std::string default_text = std::visit(
      [](auto* value) -> std::string {
        using T = std::remove_pointer_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return *value;
        } else if constexpr (std::is_same_v<T, bool>) {
          return *value ? "true" : "";
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          return value->has_value() ? absl::StrFormat("%g", **value) : "";
        } else if constexpr (std::is_same_v<T, double>) {
          return absl::StrFormat("%g", *value);
        } else {
          return absl::StrCat(*value);
        }
      },
      target);
  flags_.push_back(
      Flag{name, target, std::move(help), std::move(default_text)});
}

const FlagParser::Flag* FlagParser::Find(const std::string& name) const {
  auto it = std::find_if(flags_.begin(), flags_.end(),
                         [&](const Flag& flag) { return flag.name == name; });
  return it == flags_.end() ? nullptr : &*it;
}

absl::Status FlagParser::Assign(const Flag& flag, const std::string& text) {
  auto bad_value = [&](const char* expected) {
    return FlagValueError(flag.name, text, expected);
  };
  return std::visit(
      [&](auto* value) -> absl::Status {
        using T = std::remove_pointer_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::string>) {
          *value = text;
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!absl::SimpleAtob(text, value)) return bad_value("true or false");
        } else if constexpr (std::is_same_v<T, int> ||
                             std::is_same_v<T, int64_t>) {
          if (!absl::SimpleAtoi(text, value)) return bad_value("an integer");
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          if (!absl::SimpleAtoi(text, value)) {
            return bad_value("a non-negative integer");
          }
        } else {
          double parsed;
          if (!absl::SimpleAtod(text, &parsed)) return bad_value("a number");
          *value = parsed;
        }
        return absl::OkStatus();
      },
      flag.target);
}

absl::StatusOr<std::vector<std::string>> FlagParser::Parse(
    const std::vector<std::string>& args) {
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      positional.insert(positional.end(), args.begin() + i + 1, args.end());
      break;
    }
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      return positional;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      positional.push_back(arg);
      continue;
    }
    if (arg[1] != '-') {
      return FlagError(
          absl::StrCat("unknown flag ", arg, " (flags start with --)"));
    }
    const size_t equals = arg.find('=');
    const std::string name = arg.substr(2, equals - 2);
    const Flag* flag = Find(name);
    if (flag == nullptr) {
      return FlagError(absl::StrCat("unknown flag --", name));
    }
    std::string value;
    if (equals != std::string::npos) {
      value = arg.substr(equals + 1);
    } else if (std::holds_alternative<bool*>(flag->target)) {
      value = "true";
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return FlagError(absl::StrCat("flag --", name, " needs a value"));
    }
    absl::Status assigned = Assign(*flag, value);
    if (!assigned.ok()) return assigned;
  }
  if (positional.size() != positional_.size()) {
    return FlagError(absl::StrCat(
        "expected ", positional_.size(), " argument(s)",
        positional_.empty()
            ? ""
            : absl::StrCat(" (", absl::StrJoin(positional_, " "), ")"),
        ", got ", positional.size(),
        positional.empty()
            ? ""
            : absl::StrCat(" (", absl::StrJoin(positional, " "), ")")));
  }
  return positional;
}

std::string FlagParser::UsageLine() const {
  std::string line = absl::StrCat("usage: ", usage_);
  for (const std::string& name : positional_) absl::StrAppend(&line, " ", name);
  return absl::StrCat(line, " [flags]");
}

std::string FlagParser::Help() const {
  std::vector<std::pair<std::string, std::string>> rows;
  for (const Flag& flag : flags_) {
    std::string left = absl::StrCat("--", flag.name);
    absl::StrAppend(&left, std::visit(
                               [](auto* value) -> std::string {
                                 using T =
                                     std::remove_pointer_t<decltype(value)>;
                                 if constexpr (std::is_same_v<T, std::string>) {
                                   return " STR";
                                 } else if constexpr (std::is_same_v<T, bool>) {
                                   return "";
                                 } else if constexpr (std::is_integral_v<T>) {
                                   return " N";
                                 } else {
                                   return " X";
                                 }
                               },
                               flag.target));
    std::string right = flag.help;
    if (!flag.default_text.empty()) {
      absl::StrAppend(&right, " (default: ", flag.default_text, ")");
    }
    rows.emplace_back(std::move(left), std::move(right));
  }
  rows.emplace_back("-h, --help", "show this help");
  size_t width = 0;
  for (const auto& row : rows) width = std::max(width, row.first.size());

  std::string help = absl::StrCat(
      UsageLine(), "\n\n", WrapWords(description_, 79), "\n\n", "flags:\n");
  for (const auto& [left, right] : rows) {
    absl::StrAppend(&help, "  ", left,
                    std::string(width - left.size() + 2, ' '), right, "\n");
  }
  return help;
}

}  // namespace tally
