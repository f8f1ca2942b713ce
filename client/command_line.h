// FlagParser: the flags and positional arguments of one CLI subcommand
// (tallyctl's), bound straight to typed variables, with generated --help.
//
// Flags are `--name value` or `--name=value`; a bool flag is just `--name`.
// `--` ends the flags. Parse errors are INVALID_ARGUMENT naming the flag,
// marked as command-line errors (IsFlagError): a CLI exits 2 for them, and
// for the flag values it checks itself (FlagValueError), but 1 for a
// server's INVALID_ARGUMENT.
//
//   int steps = 30;
//   std::optional<double> lr;  // absent unless given
//   tally::FlagParser flags("tallyctl train", {"MODEL"}, "Trains MODEL.");
//   flags.Add("steps", &steps, "optimizer steps to take");
//   flags.Add("lr", &lr, "learning rate (default: the model's)");
//   TALLY_ASSIGN_OR_RETURN(std::vector<std::string> positional,
//                          flags.Parse(args));
//   if (flags.help_requested()) std::cout << flags.Help();
#ifndef TALLY_CLIENT_COMMAND_LINE_H_
#define TALLY_CLIENT_COMMAND_LINE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tally {

// INVALID_ARGUMENT `message`, marked as an error in the command line.
absl::Status FlagError(absl::string_view message);
// FlagError "flag --<flag>: '<value>' is not <expected>".
absl::Status FlagValueError(absl::string_view flag, absl::string_view value,
                            absl::string_view expected);
// True for the errors FlagError made (and FlagParser::Parse returns).
bool IsFlagError(const absl::Status& status);

class FlagParser {
 public:
  // `usage` names the command as typed (e.g. "tallyctl train");
  // `positional` names the required positional arguments, in order.
  FlagParser(std::string usage, std::vector<std::string> positional,
             std::string description);

  // Binds --name to *value; the value it holds now is the documented
  // default. Names are kebab-case, without the leading dashes.
  void Add(const std::string& name, std::string* value, std::string help);
  void Add(const std::string& name, int* value, std::string help);
  void Add(const std::string& name, int64_t* value, std::string help);
  void Add(const std::string& name, uint64_t* value, std::string help);
  void Add(const std::string& name, double* value, std::string help);
  void Add(const std::string& name, std::optional<double>* value,
           std::string help);
  void Add(const std::string& name, bool* value, std::string help);

  // Assigns the bound variables and returns the positional arguments.
  // After --help or -h nothing more is checked: see help_requested().
  absl::StatusOr<std::vector<std::string>> Parse(
      const std::vector<std::string>& args);

  bool help_requested() const { return help_requested_; }

  // "usage: ..." line, description, and one line per flag with its default.
  std::string Help() const;
  std::string UsageLine() const;

 private:
  using Target = std::variant<std::string*, int*, int64_t*, uint64_t*, double*,
                              std::optional<double>*, bool*>;
  struct Flag {
    std::string name;
    Target target;
    std::string help;
    std::string default_text;  // empty: no default worth showing
  };

  void AddFlag(const std::string& name, Target target, std::string help);
  const Flag* Find(const std::string& name) const;
  static absl::Status Assign(const Flag& flag, const std::string& text);

  std::string usage_;
  std::vector<std::string> positional_;
  std::string description_;
  std::vector<Flag> flags_;
  bool help_requested_ = false;
};

}  // namespace tally

#endif  // TALLY_CLIENT_COMMAND_LINE_H_
