#include "server/executor.h"

#include <exception>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/log.h"

namespace tally {

CommandExecutor::CommandExecutor(Liveness* liveness)
    : heartbeat_(liveness == nullptr
                     ? nullptr
                     : liveness->Register("executor", Liveness::kLoopBound)),
      thread_([this] { Loop(); }) {}

CommandExecutor::~CommandExecutor() { Stop(); }

bool CommandExecutor::Submit(std::function<void()> command) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  queue_.push_back(std::move(command));
  return true;
}

void CommandExecutor::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  heartbeat_.reset();  // no loop left to watch
}

bool CommandExecutor::HasWorkOrStopping() const {
  return stopping_ || !queue_.empty();
}

void CommandExecutor::Loop() {
  const absl::Condition work(this, &CommandExecutor::HasWorkOrStopping);
  const absl::Duration period =
      heartbeat_ ? heartbeat_->period() : absl::InfiniteDuration();
  while (true) {
    std::function<void()> command;
    if (heartbeat_) heartbeat_->Beat();
    {
      absl::MutexLock lock(&mu_);
      if (!mu_.AwaitWithTimeout(work, period)) continue;  // idle: beat again
      if (queue_.empty()) return;  // stopping and drained
      command = std::move(queue_.front());
      queue_.pop_front();
    }
    // Commands answer their own failures (RequestScheduler turns a thrown
    // exception into INTERNAL); one that still escapes must not end the
    // process, nor the commands queued behind it.
    Liveness::Busy busy(heartbeat_.get());
    try {
      command();
    } catch (const std::exception& e) {
      Log(LogLevel::kError,
          absl::StrCat("a queued command threw and was dropped: ", e.what()));
    } catch (...) {
      Log(LogLevel::kError, "a queued command threw and was dropped");
    }
  }
}

}  // namespace tally
