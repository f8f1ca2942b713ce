#include "server/server_info.h"

#include <torch/torch.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "runtime/config/families/registry.h"
#include "runtime/config/loss_spec.h"
#include "runtime/parallel/compute_backend.h"

namespace tally {
namespace {

void FillCompute(v1::ServerInfo::Compute* compute) {
  const ComputeBackend backend = DetectComputeBackend();
  compute->set_blas(std::string(BlasVendorName(backend.blas)));
  compute->set_blas_library(backend.blas_library);
  compute->set_onednn(backend.onednn);
  compute->set_threads(backend.threads);
  compute->set_cuda_available(torch::cuda::is_available());
}

void FillMesh(const Mesh& mesh, ZeroStage zero_stage,
              v1::ServerInfo::Mesh* out) {
  const MeshShape& shape = mesh.shape();
  out->set_world_size(shape.world_size());
  out->set_dp_replicate(shape.dp_replicate);
  out->set_dp_shard(shape.dp_shard);
  out->set_cp(shape.cp);
  out->set_ep(shape.ep);
  out->set_pp(shape.pp);
  out->set_tp(shape.tp);
  out->set_zero_stage(static_cast<int>(zero_stage));
}

}  // namespace

v1::ServerInfo::Devices DescribeDevices(const RankDevice& chosen,
                                        bool allow_tf32,
                                        const CudaFacts& facts) {
  v1::ServerInfo::Devices devices;
  devices.set_device(chosen.device.str());
  devices.set_reason(chosen.why);
  devices.set_cuda_driver_version(facts.driver_version);
  devices.set_cuda_runtime_version(facts.runtime_version);
  devices.set_nccl_version(facts.nccl_version);
  for (const GpuFacts& gpu : facts.gpus) {
    v1::ServerInfo::Devices::Gpu* out = devices.add_gpus();
    out->set_index(gpu.index);
    out->set_name(gpu.name);
    out->set_compute_capability(absl::StrCat(gpu.compute_capability_major, ".",
                                             gpu.compute_capability_minor));
    out->set_total_memory_bytes(gpu.total_memory_bytes);
  }
  devices.set_no_gpu_reason(facts.no_gpu_reason);
  devices.set_allow_tf32(allow_tf32);
  return devices;
}

void FillServerInfo(const Mesh& mesh, ZeroStage zero_stage,
                    const v1::ServerInfo::Limits& limits,
                    const v1::ServerInfo::Devices& devices, bool authentication,
                    v1::ServerInfo* info) {
  info->set_version(TALLY_VERSION);
  FillCompute(info->mutable_compute());
  FillMesh(mesh, zero_stage, info->mutable_mesh());
  for (const std::string& type : SupportedModelTypes()) {
    info->add_model_types(type);
  }
  for (const v1::DType dtype :
       {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT64, v1::DTYPE_BFLOAT16}) {
    info->add_dtypes(dtype);
  }
  for (const v1::LossReduction reduction :
       {v1::LOSS_REDUCTION_TOKEN_MEAN, v1::LOSS_REDUCTION_SAMPLE_MEAN,
        v1::LOSS_REDUCTION_SUM}) {
    info->add_reductions(reduction);
  }
  for (const std::string& loss : LossNames()) info->add_losses(loss);
  for (const char* feature :
       {"seq_id", "activation_checkpointing", "bf16_mixed_precision",
        "export_weights", "list_models_pagination", "lora", "blocked_attention",
        "zero_stages", "sample", "sampler_snapshots", "artifacts"}) {
    info->add_features(feature);
  }
  *info->mutable_limits() = limits;
  *info->mutable_devices() = devices;
  info->set_authentication(authentication);
}

}  // namespace tally
