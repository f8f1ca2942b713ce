#include "server/checkpoint_retention.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

constexpr char kStepPrefix[] = "step-";

}  // namespace

std::string StepCheckpointDir(const std::string& model_dir, int64_t step) {
  return (fs::path(model_dir) / absl::StrFormat("%s%012d", kStepPrefix, step))
      .string();
}

std::vector<std::string> ListStepCheckpoints(const std::string& model_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code error;
  for (fs::directory_iterator it(model_dir, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    int64_t step;
    if (absl::StartsWith(name, kStepPrefix) &&
        absl::SimpleAtoi(name.substr(sizeof(kStepPrefix) - 1), &step) &&
        step >= 0 && it->is_directory()) {
      found.emplace_back(step, it->path().string());
    }
  }
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> dirs;
  for (auto& [step, dir] : found) dirs.push_back(std::move(dir));
  return dirs;
}

absl::Status PruneStepCheckpoints(const std::string& model_dir, int keep) {
  const std::vector<std::string> dirs = ListStepCheckpoints(model_dir);
  for (size_t i = std::max(keep, 0); i < dirs.size(); ++i) {
    std::error_code error;
    fs::remove_all(dirs[i], error);
    if (error) {
      return absl::ErrnoToStatus(error.value(),
                                 absl::StrCat("remove ", dirs[i]));
    }
  }
  std::error_code error;
  for (fs::directory_iterator it(model_dir, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (absl::StartsWith(name, absl::StrCat(".", kStepPrefix))) {
      std::error_code ignored;
      fs::remove_all(it->path(), ignored);
    }
  }
  return absl::OkStatus();
}

PeriodicSweep::PeriodicSweep(absl::Duration interval,
                             std::function<void()> pass)
    : interval_(interval),
      pass_(std::move(pass)),
      thread_([this] { Loop(); }) {}

PeriodicSweep::~PeriodicSweep() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void PeriodicSweep::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      const absl::Time due = absl::Now() + interval_;
      mu_.AwaitWithDeadline(absl::Condition(&stopping_), due);
      if (stopping_) return;
    }
    pass_();
  }
}

}  // namespace tally
