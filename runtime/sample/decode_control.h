// DecodeControl: what the request a thread is executing tells a decode
// (decode.h) running under it, without passing through the layers between
// the server's scheduler and the decode loop: why to stop early (its caller
// cancelled, or its deadline passed) and where to report progress. Torch-free,
// so that the server's scheduler can install it.
//
// The scheduler installs one around each command it runs; a decode on that
// thread reads it. Only rank 0 has one: the other ranks learn of a stop
// through the decode's agreement (mesh_decode.h), every kStopCheckSteps
// steps.
//
//   tally::DecodeControl control;
//   control.stop = [&] { return StillWanted(); };  // OK: go on
//   control.on_progress = [&](const tally::DecodeStats& stats) { ... };
//   tally::ScopedDecodeControl installed(&control);
//   RunTheCommand();  // a Decode in it polls control.stop
#ifndef TALLY_RUNTIME_SAMPLE_DECODE_CONTROL_H_
#define TALLY_RUNTIME_SAMPLE_DECODE_CONTROL_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"

namespace tally {

// A decode polls DecodeControl::stop, and the ranks agree to stop, before
// the first token is chosen and then every kStopCheckSteps tokens: a stopped
// decode ends within this many steps of the stop.
inline constexpr int64_t kStopCheckSteps = 8;

// A decode's state on this rank as it goes, reported after every step.
struct DecodeStats {
  int64_t active_sequences = 0;  // sequences this rank still decodes
  int64_t cache_bytes = 0;       // its KV cache's storage (KvCache::bytes)
  // Tokens chosen per sequence so far: 1 after the prefill's step (the
  // first token), then one more per step; 0 in the final report.
  int64_t step = 0;
  // Seconds since the previous report: for step 1, since the decode began
  // (the time to first token); then the step's (per-token latency).
  double step_seconds = 0.0;
  bool done = false;  // the final report: active_sequences and cache 0
};

struct DecodeControl {
  // OK while the caller still wants the answer; otherwise why not
  // (CANCELLED, DEADLINE_EXCEEDED), which the decode returns. Null: never.
  std::function<absl::Status()> stop;
  // Called after every step and once at the end. Null: not reported.
  std::function<void(const DecodeStats& stats)> on_progress;
};

// `control`'s stop, polled: OK when `control` or its stop is null.
inline absl::Status PollStop(const DecodeControl* control) {
  if (control == nullptr || !control->stop) return absl::OkStatus();
  return control->stop();
}

// Installs `control` (not owned, outlives this) as the current thread's
// DecodeControl until destroyed; nests (restores the previous one).
class ScopedDecodeControl {
 public:
  explicit ScopedDecodeControl(const DecodeControl* control)
      : previous_(Slot()) {
    Slot() = control;
  }
  ~ScopedDecodeControl() { Slot() = previous_; }
  ScopedDecodeControl(const ScopedDecodeControl&) = delete;
  ScopedDecodeControl& operator=(const ScopedDecodeControl&) = delete;

  // The current thread's, or null when none is installed.
  static const DecodeControl* Current() { return Slot(); }

 private:
  static const DecodeControl*& Slot() {
    thread_local const DecodeControl* current = nullptr;
    return current;
  }

  const DecodeControl* previous_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_SAMPLE_DECODE_CONTROL_H_
