// GetServerInfo's answer: what this server is (version, compute backend,
// mesh) and what it accepts (model families, dtypes, reductions, losses,
// features) and allows (limits). Clients read it instead of assuming.
//
//   v1::ServerInfo info;
//   tally::FillServerInfo(engine.mesh(), engine.zero_stage(), limits,
//                         /*authentication=*/true, &info);
#ifndef TALLY_SERVER_SERVER_INFO_H_
#define TALLY_SERVER_SERVER_INFO_H_

#include "runtime/mesh.h"
#include "runtime/types.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

// Fills every field of `info`; `limits` as the server was started with.
void FillServerInfo(const Mesh& mesh, ZeroStage zero_stage,
                    const v1::ServerInfo::Limits& limits, bool authentication,
                    v1::ServerInfo* info);

}  // namespace tally

#endif  // TALLY_SERVER_SERVER_INFO_H_
