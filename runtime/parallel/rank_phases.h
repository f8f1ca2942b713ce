// RankPhases: how one rank of an engine ends the phases of a command — the
// agreement of a phase without collectives, and FinishPhase
// (runtime/parallel/phase_boundary.h) of one with them — over the engine's
// process groups, or over its one single-rank group. A value the engine hands
// to the units that run a phase on its behalf (runtime/engine/consolidation.h).
//
//   tally::RankPhases phases(process_groups, *groups.world);
//   TALLY_RETURN_IF_ERROR(phases.Agree(ReadSomething()));   // no collectives
//   TALLY_RETURN_IF_ERROR(phases.Finish(GatherSomething()));  // collectives
#ifndef TALLY_RUNTIME_PARALLEL_RANK_PHASES_H_
#define TALLY_RUNTIME_PARALLEL_RANK_PHASES_H_

#include "absl/status/status.h"
#include "runtime/parallel/communicator.h"
#include "runtime/parallel/distributed.h"

namespace tally {

class RankPhases {
 public:
  // `process_groups` is nullptr for a single-rank engine, whose every group
  // is `world`; both outlive this.
  RankPhases(ProcessGroups* process_groups, Communicator& world)
      : process_groups_(process_groups), world_(&world) {}

  // The first failure of a collective on this rank's groups, OK while there
  // was none (ProcessGroups::failure).
  absl::Status CollectiveFailure() const;
  // AgreeOnStatus over `group` on this command, skipped once a collective
  // failed: then a peer is dead or hung, agreeing would wait out another
  // timeout, and the rank is done anyway.
  absl::Status AgreeUnlessFailed(Communicator& group, absl::Status local) const;
  // Every rank returns an error if any rank's `local` is one, so no rank
  // applies what another refused; the outcome is marked agreed (MarkAgreed).
  // Ends a phase without collectives; one with collectives ends in Finish.
  absl::Status Agree(absl::Status local) const;
  // A local failure inside a pass whose schedule agrees over other groups
  // before the phase ends: closes this rank's groups so no peer waits for it
  // (ProcessGroups::FailFast). Nothing on one rank.
  void FailFast(const absl::Status& local) const;
  // The end of a phase that ran collectives (FinishPhase); `local` unchanged
  // on one rank.
  absl::Status Finish(absl::Status local) const;

 private:
  ProcessGroups* process_groups_;
  Communicator* world_;
};

}  // namespace tally

#endif  // TALLY_RUNTIME_PARALLEL_RANK_PHASES_H_
