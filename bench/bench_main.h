// The main() of a bench binary: parse its absl flags (ABSL_FLAG definitions
// in the bench's .cc), turn them into the bench's options, run, and report a
// failure under the bench's name: exit status 2 for a bad command-line flag
// (the project's rule), 1 for a failed run.
//
//   ABSL_FLAG(int, rounds, 5, "timed rounds (>= 1)");
//   ...
//   absl::StatusOr<Options> OptionsFromFlags();  // reads and checks them
//   int main(int argc, char** argv) {
//     return tally::BenchMain("bench_rpc", tally::kUsage, argc, argv,
//                             tally::OptionsFromFlags, tally::Run);
//   }
//
// Flags are written `--name=value` or `--name value` (booleans also bare);
// a name may use '-' for the '_' of its absl name (`--overlap-only` is
// FLAGS_overlap_only). --help lists the bench's flags. An unknown flag, a
// value of the wrong type or a missing value is refused here before absl's
// parser sees it (which would exit 1 itself); ranges are the bench's
// OptionsFromFlags' to check.
#ifndef TALLY_BENCH_BENCH_MAIN_H_
#define TALLY_BENCH_BENCH_MAIN_H_

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace tally {

// The median of `values` (the mean of the middle two for an even count);
// benches report medians of their timed rounds.
inline double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// `arg` with the '-' of a `--kebab-name[=value]` flag name turned into '_'
// (the value is left alone); anything else unchanged.
inline std::string AbslFlagArg(std::string arg) {
  if (arg.size() < 3 || arg.compare(0, 2, "--") != 0 || arg[2] == '-') {
    return arg;
  }
  for (size_t i = 2; i < arg.size() && arg[i] != '='; ++i) {
    if (arg[i] == '-') arg[i] = '_';
  }
  return arg;
}

// INVALID_ARGUMENT naming the first of `args` (argv after AbslFlagArg) that
// absl's parser would refuse: an unknown flag, a value its flag cannot parse,
// a non-boolean flag without a value. Flags are written -name or --name,
// =value or the next argument as the value, --noname for a boolean false;
// "--" ends them.
inline absl::Status CheckFlagArgs(const std::vector<std::string>& args) {
  for (size_t i = 1; i < args.size() && args[i] != "--"; ++i) {
    absl::string_view body = args[i];
    if (body.size() < 2 || !absl::ConsumePrefix(&body, "-")) continue;
    absl::ConsumePrefix(&body, "-");
    const size_t equals = body.find('=');
    const bool inline_value = equals != absl::string_view::npos;
    absl::string_view name = body.substr(0, equals);
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && !inline_value && absl::ConsumePrefix(&name, "no")) {
      const absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name);
      if (negated != nullptr && negated->IsOfType<bool>()) continue;
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag ", args[i], " (see --help)"));
    }
    std::string value;
    if (inline_value) {
      value = std::string(body.substr(equals + 1));
    } else if (flag->IsOfType<bool>()) {
      continue;
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag->Name(), " needs a value"));
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag->Name(), ": ", error));
    }
  }
  return absl::OkStatus();
}

// Sets `usage` as the program's usage message (what --help prints above the
// flags) and parses argv into the absl flags; once per process.
// INVALID_ARGUMENT for positional arguments and for what CheckFlagArgs
// refuses.
inline absl::Status ParseBenchFlags(const char* usage, int argc, char** argv) {
  absl::SetProgramUsageMessage(usage);
  std::vector<std::string> args;
  bool flags_ended = false;  // after "--" every argument is positional
  for (int i = 0; i < argc; ++i) {
    args.push_back(flags_ended ? argv[i] : AbslFlagArg(argv[i]));
    flags_ended |= args.back() == "--";
  }
  const absl::Status checked = CheckFlagArgs(args);
  if (!checked.ok()) return checked;
  std::vector<char*> pointers;
  for (std::string& arg : args) pointers.push_back(arg.data());
  pointers.push_back(nullptr);
  const std::vector<char*> positional =
      absl::ParseCommandLine(argc, pointers.data());
  if (positional.size() > 1) {  // positional[0] is the program
    return absl::InvalidArgumentError(absl::StrCat(
        "unexpected argument ",
        absl::StrJoin(positional.begin() + 1, positional.end(), " "),
        " (see --help)"));
  }
  return absl::OkStatus();
}

// The exit status of a bench refusing its command line.
inline constexpr int kBadFlagExitStatus = 2;

// ParseBenchFlags, then the bench's options from its flags (bench_comm,
// whose main() reports for the launcher and the ranks apart, calls this).
template <typename Options>
absl::StatusOr<Options> ParseBenchOptions(
    const char* usage, int argc, char** argv,
    absl::StatusOr<Options> (*options_from_flags)()) {
  const absl::Status parsed = ParseBenchFlags(usage, argc, argv);
  if (!parsed.ok()) return parsed;
  return options_from_flags();
}

template <typename Options>
int BenchMain(const char* name, const char* usage, int argc, char** argv,
              absl::StatusOr<Options> (*options_from_flags)(),
              absl::Status (*run)(const Options&)) {
  const absl::StatusOr<Options> options =
      ParseBenchOptions(usage, argc, argv, options_from_flags);
  if (!options.ok()) {
    std::cerr << name << ": " << options.status() << "\n";
    return kBadFlagExitStatus;
  }
  const absl::Status status = run(*options);
  if (!status.ok()) {
    std::cerr << name << ": " << status << "\n";
    return 1;
  }
  return 0;
}

}  // namespace tally

#endif  // TALLY_BENCH_BENCH_MAIN_H_
