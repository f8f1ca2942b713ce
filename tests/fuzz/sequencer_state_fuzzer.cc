// libFuzzer target: untrusted bytes through SequencerState::Parse
// (server/sequencer.h), the sequencing state a checkpoint's server_state.bin
// carries. Parse must reject what Serialize did not produce, so an accepted
// input in the current encoding must be exactly Serialize() of the parsed
// state (the encoding is canonical), one in the older encoding (outcomes
// without reasons) must re-encode to a state that parses back the same, its
// strict prefixes must be rejected, and a Sequencer must import it and export
// the same state.
//
//   build/tests/fuzz/fuzzers-build/sequencer_state_fuzzer -runs=20000
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/sequencer.h"

namespace tally {
namespace {

void Require(bool invariant) {
  if (!invariant) abort();
}

// One Sequencer for the whole run (it owns a timer thread), with one model
// every accepted state is imported into. Never destroyed.
Sequencer& SharedSequencer() {
  static Sequencer* sequencer = [] {
    auto* s = new Sequencer(SequencerOptions(), SequencerHooks());
    s->AddModel("m");
    return s;
  }();
  return *sequencer;
}

void CheckImport(const SequencerState& state, absl::string_view bytes) {
  Sequencer& sequencer = SharedSequencer();
  Require(sequencer.ImportState("m", state).ok());
  absl::StatusOr<SequencerState> exported = sequencer.ExportState("m");
  Require(exported.ok());
  // The default retention keeps every restored outcome.
  Require(exported->Serialize() == bytes);
}

}  // namespace
}  // namespace tally

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tally;
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<SequencerState> state = SequencerState::Parse(bytes);
  if (!state.ok()) return 0;
  const std::string canonical = state->Serialize();
  const bool current_encoding = bytes.substr(0, 4) == canonical.substr(0, 4);
  Require(!current_encoding || canonical == bytes);
  absl::StatusOr<SequencerState> again = SequencerState::Parse(canonical);
  Require(again.ok() && again->Serialize() == canonical);
  Require(!SequencerState::Parse(bytes.substr(0, size - 1)).ok());
  uint64_t previous = 0;
  for (const SequencerState::Outcome& outcome : state->outcomes) {
    Require(outcome.seq_id > previous && outcome.seq_id < state->next_seq_id);
    previous = outcome.seq_id;
  }
  CheckImport(*state, canonical);
  return 0;
}
