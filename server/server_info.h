// GetServerInfo's answer: what this server is (version, compute backend,
// mesh) and what it accepts (model families, dtypes, reductions, losses,
// features) and allows (limits). Clients read it instead of assuming.
//
//   const v1::ServerInfo::Devices devices = tally::DescribeDevices(
//       chosen, /*allow_tf32=*/false, tally::QueryCudaFacts());  // at start
//   v1::ServerInfo info;
//   tally::FillServerInfo(engine.mesh(), engine.zero_stage(), limits,
//                         devices, /*authentication=*/true, &info);
#ifndef TALLY_SERVER_SERVER_INFO_H_
#define TALLY_SERVER_SERVER_INFO_H_

#include "runtime/config/types.h"
#include "runtime/parallel/device.h"
#include "runtime/parallel/device_query.h"
#include "runtime/parallel/mesh.h"
#include "tally/v1/trainer.pb.h"

namespace tally {

// Fills every field of `info`; `limits` and `devices` as the server was
// started with.
void FillServerInfo(const Mesh& mesh, ZeroStage zero_stage,
                    const v1::ServerInfo::Limits& limits,
                    const v1::ServerInfo::Devices& devices, bool authentication,
                    v1::ServerInfo* info);

// The host's GPUs from `facts` and the device this rank chose.
v1::ServerInfo::Devices DescribeDevices(const RankDevice& chosen,
                                        bool allow_tf32,
                                        const CudaFacts& facts);

}  // namespace tally

#endif  // TALLY_SERVER_SERVER_INFO_H_
