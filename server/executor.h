// CommandExecutor: runs training commands one at a time, in arrival order, on
// a dedicated thread.
//
// gRPC callback handlers must not block, and a multi-rank engine must execute
// the same command sequence on every rank, so every engine call goes through
// this single queue. Stop() runs what is already queued, then joins. A
// command that throws is logged and dropped; the loop goes on. With a
// Liveness, the loop beats as "executor" while it waits for work and is busy
// while a command runs (server/health.h), until Stop() returns.
//
//   tally::CommandExecutor executor(&liveness);
//   if (!executor.Submit([&] { engine->OptimStep(id, args); })) { ... }
//   executor.Stop();
#ifndef TALLY_SERVER_EXECUTOR_H_
#define TALLY_SERVER_EXECUTOR_H_

#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "server/health.h"

namespace tally {

class CommandExecutor {
 public:
  // `liveness` (optional, outlives the executor) watches the loop.
  explicit CommandExecutor(Liveness* liveness = nullptr);
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
  // Null once stopped. Only the loop's thread uses it before.
  std::unique_ptr<Liveness::Heartbeat> heartbeat_;
  std::thread thread_;
};

}  // namespace tally

#endif  // TALLY_SERVER_EXECUTOR_H_
