#include "tests/testing/hf_reference.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace tally::testing {
namespace {

namespace fs = std::filesystem;

constexpr char kPython[] = "/usr/bin/python3";

std::string ReferenceScript() {
  const char* source_dir = std::getenv("TALLY_SOURCE_DIR");
  const fs::path root =
      source_dir != nullptr
          ? fs::path(source_dir)
          : fs::path(__FILE__).parent_path().parent_path().parent_path();
  return (root / "tests" / "python" / "hf_reference.py").string();
}

// `command`'s stdout and stderr, and whether it exited 0.
bool RunCommand(const std::string& command, std::string& output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return false;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) {
    output.append(buffer, n);
  }
  return pclose(pipe) == 0;
}

}  // namespace

bool ReferencePythonAvailable() { return fs::exists(kPython); }

absl::StatusOr<std::vector<ReferenceDecode>> ReferenceGreedy(
    const std::string& model_dir,
    const std::vector<std::vector<int64_t>>& prompts, int64_t max_tokens,
    const std::string& dtype) {
  std::string command = absl::StrCat(
      kPython, " '", ReferenceScript(), "' greedy --model '", model_dir,
      "' --max-tokens ", max_tokens, " --dtype ", dtype);
  for (const std::vector<int64_t>& prompt : prompts) {
    absl::StrAppend(&command, " --prompt ", absl::StrJoin(prompt, ","));
  }
  std::string output;
  if (!RunCommand(command, output)) {
    return absl::InternalError(absl::StrCat(command, " failed:\n", output));
  }
  const std::vector<std::string> lines =
      absl::StrSplit(output, '\n', absl::SkipEmpty());
  if (lines.size() != prompts.size()) {
    return absl::InternalError(absl::StrCat(command, " printed ", lines.size(),
                                            " lines for ", prompts.size(),
                                            " prompts:\n", output));
  }
  std::vector<ReferenceDecode> decoded;
  try {
    for (const std::string& line : lines) {
      const nlohmann::json reference = nlohmann::json::parse(line);
      decoded.push_back({reference.at("tokens").get<std::vector<int64_t>>(),
                         reference.at("logprobs").get<std::vector<double>>()});
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(
        command, " printed no JSON lines: ", e.what(), "\n", output));
  }
  return decoded;
}

}  // namespace tally::testing
