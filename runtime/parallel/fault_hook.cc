#include "runtime/parallel/fault_hook.h"

#include <utility>

namespace tally {
namespace {

FaultHook& Hook() {
  static auto* hook = new FaultHook();
  return *hook;
}

}  // namespace

void SetFaultHook(FaultHook hook) { Hook() = std::move(hook); }

absl::Status InjectedFault(FaultPoint point) {
  const FaultHook& hook = Hook();
  return hook ? hook(point) : absl::OkStatus();
}

}  // namespace tally
