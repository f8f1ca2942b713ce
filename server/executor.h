// CommandExecutor: runs training commands one at a time, in arrival order, on
// a dedicated thread.
//
// gRPC callback handlers must not block, and a multi-rank engine must execute
// the same command sequence on every rank, so every engine call goes through
// this single queue. Stop() runs what is already queued, then joins. A
// command that throws is logged and dropped; the loop goes on.
//
//   tally::CommandExecutor executor;
//   if (!executor.Submit([&] { engine->OptimStep(id, args); })) { ... }
//   executor.Stop();
#ifndef TALLY_SERVER_EXECUTOR_H_
#define TALLY_SERVER_EXECUTOR_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace tally {

class CommandExecutor {
 public:
  CommandExecutor();
  ~CommandExecutor();
  CommandExecutor(const CommandExecutor&) = delete;
  CommandExecutor& operator=(const CommandExecutor&) = delete;

  // False (and `command` is dropped) once Stop() has begun.
  bool Submit(std::function<void()> command);
  void Stop();

 private:
  void Loop();
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tally

#endif  // TALLY_SERVER_EXECUTOR_H_
