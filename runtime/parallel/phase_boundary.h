// The end of a phase of a command on a mesh: where a failure of one rank
// alone, which may have left its peers waiting in a collective it skipped,
// becomes the same status on every rank, and the process groups are made
// whole again (ProcessGroups::FailFast and Recover,
// runtime/parallel/distributed.h).
//
// Every phase of a command that runs collectives ends in FinishPhase on every
// rank; a phase without collectives may end in a plain agreement (its failing
// rank skipped none), whose outcome MarkAgreed marks so that a later boundary
// neither agrees on it again nor takes it for a failure of this rank alone:
//
//   absl::Status local = GatherSomething();   // fails on one rank, partway
//   local = tally::FinishPhase(*groups, local);  // alike on every rank
//   if (!local.ok()) return local;              // groups usable again
#ifndef TALLY_RUNTIME_PARALLEL_PHASE_BOUNDARY_H_
#define TALLY_RUNTIME_PARALLEL_PHASE_BOUNDARY_H_

#include "absl/status/status.h"
#include "runtime/parallel/distributed.h"

namespace tally {

// Marks a status that every rank holds already (an agreement's outcome). OK
// stays OK.
absl::Status MarkAgreed(absl::Status status);
bool IsAgreed(const absl::Status& status);

// At the end of a phase that ran collectives, on every rank, with this rank's
// outcome `local`: a failure that no agreement covered (!IsAgreed) was this
// rank's alone, and its peers may wait in a collective it skipped, so it
// calls groups.FailFast; unless a group failed, the ranks then agree on the
// status over groups.world() (AgreeOnStatus: one all-reduce when all went
// well, so a rank that failed after the phase's last collective is heard
// too); then groups.Recover. Returns the same status on every rank, marked
// agreed: the failing rank's own, its code on the others, quoted naming it.
// A failure nobody announced (a dead or hung rank, a timeout) leaves the
// groups failed, as Recover does.
absl::Status FinishPhase(ProcessGroups& groups, absl::Status local);

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_PHASE_BOUNDARY_H_
