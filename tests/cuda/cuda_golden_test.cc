// Golden tests of the CUDA device: the same model, samples and steps on a
// CPU engine and a CUDA engine (EngineOptions::device) in one process. fp64
// must agree to 1e-10 relative (losses, every gradient, the norm, the clip
// coefficient and every updated parameter), float32 within the fp32 golden
// bounds, and bf16 must be as close to the CPU's float32 run as the CPU's own
// bf16 run is (the mixed-precision contract of docs/distributed.md). Each
// window is two calls, so the device's accumulation is covered too.
//
// Without a GPU, or with a LibTorch that has no CUDA (Debian's), every test
// reports itself skipped with the reason.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#if TALLY_WITH_NCCL
#include "runtime/cuda/nccl_communicator.h"
#endif
#include "runtime/config/loss_spec.h"
#include "runtime/engine/engine.h"
#include "runtime/parallel/distributed.h"
#include "runtime/parallel/mesh.h"
#include "tests/testing/engine_test_peer.h"
#include "tests/testing/golden.h"
#include "tests/testing/test_util.h"

namespace tally {
namespace {

using testing::RelativeDiff;

// Why the CUDA engine cannot run here, or nullopt.
std::optional<std::string> MissingCuda() {
  if (!torch::cuda::is_available()) {
    return std::string(at::hasCUDA() ? "no CUDA device is visible"
                                     : "this LibTorch has no CUDA");
  }
  return std::nullopt;
}

struct DeviceCase {
  const char* name;
  const char* family = nullptr;  // nullptr: llama (mixtral with moe)
  bool moe = false;
  bool lora = false;
  const char* loss = "cross_entropy";
  LossReduction reduction = LossReduction::kTokenMean;
};

ModelSpec CaseSpec(const DeviceCase& c, DType dtype) {
  ModelSpec spec = testing::TinySpec(c.name, dtype, OptimizerKind::kAdamW);
  if (c.moe) spec.config = testing::MoeConfig(spec.config);
  spec.config = testing::FamilyConfig(spec.config, c.family);
  if (c.lora) spec.lora = testing::TestLora();
  return spec;
}

// The window's two calls: samples of mixed lengths and valid counts, with
// the RL inputs when the loss needs them.
std::vector<ForwardBackwardArgs> CaseCalls(const DeviceCase& c) {
  const int64_t vocab = testing::TinyConfig().vocab_size;
  std::vector<std::vector<Sample>> calls = {
      testing::MakeSamples(vocab, {7, 1, 0, 30}, 21),
      testing::MakeSamples(vocab, {120, 2, 9}, 23)};
  std::map<std::string, double> config;
  if (std::string(c.loss) == "dro") config["beta"] = 0.3;  // required
  const LossSpec loss = ParseLossSpec(c.loss, config).value();
  std::vector<ForwardBackwardArgs> args;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (loss.name != "cross_entropy") {
      testing::AddPolicyInputs(calls[i], -std::log(double(vocab)), 40 + i);
    }
    ForwardBackwardArgs a;
    a.samples = calls[i];
    a.reduction = c.reduction;
    a.loss = loss;
    a.return_logprobs = true;
    args.push_back(std::move(a));
  }
  return args;
}

// Small enough to clip every case's step: the coefficient is compared too.
constexpr double kMaxGradNorm = 1e-3;

struct Trained {
  std::vector<ForwardBackwardResult> calls;
  std::vector<torch::Tensor> gradients;  // before the step
  OptimStepResult step;
  std::vector<torch::Tensor> parameters;  // after it
};

// Builds `spec` on `engine` and trains one window of `calls` and one step.
absl::StatusOr<Trained> Train(Engine& engine, const ModelSpec& spec,
                              const std::vector<ForwardBackwardArgs>& calls,
                              const OptimStepArgs& step) {
  TALLY_RETURN_IF_ERROR(engine.CreateModel(spec).status());
  Trained run;
  for (const ForwardBackwardArgs& a : calls) {
    TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult r,
                           engine.ForwardBackward(spec.model_id, a));
    run.calls.push_back(std::move(r));
  }
  TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                         EngineTestPeer::Model(engine, spec.model_id));
  for (const Parameter& p : model->parameters()) {
    if (p.trainable) run.gradients.push_back(p.tensor.grad().cpu().clone());
  }
  TALLY_ASSIGN_OR_RETURN(run.step, engine.OptimStep(spec.model_id, step));
  for (const Parameter& p : model->parameters()) {
    run.parameters.push_back(p.tensor.detach().cpu().clone());
  }
  return run;
}

class CudaGoldenTest : public ::testing::TestWithParam<DeviceCase> {
 protected:
  void SetUp() override {
    if (auto reason = MissingCuda()) GTEST_SKIP() << *reason;
#if TALLY_WITH_NCCL
    InstallNcclCommunicators();  // the CUDA engine's world of one
#endif
    EngineOptions cpu;
    EngineOptions cuda;
    cuda.device = torch::Device(torch::kCUDA, 0);
    cpu_ = Engine::CreateSingleRank(cpu).value();
    auto created = Engine::CreateSingleRank(cuda);
    ASSERT_TRUE(created.ok()) << created.status();
    cuda_ = *std::move(created);
  }

  // One window and step of `dtype` on both engines.
  void TrainBoth(DType dtype, Trained& on_cpu, Trained& on_cuda) {
    const DeviceCase& c = GetParam();
    const ModelSpec spec = CaseSpec(c, dtype);
    const std::vector<ForwardBackwardArgs> calls = CaseCalls(c);
    OptimStepArgs step;
    step.max_grad_norm = kMaxGradNorm;
    absl::StatusOr<Trained> want = Train(*cpu_, spec, calls, step);
    ASSERT_TRUE(want.ok()) << want.status();
    absl::StatusOr<Trained> got = Train(*cuda_, spec, calls, step);
    ASSERT_TRUE(got.ok()) << got.status();
    on_cpu = *std::move(want);
    on_cuda = *std::move(got);
  }

  std::unique_ptr<Engine> cpu_;
  std::unique_ptr<Engine> cuda_;
};

// fp64 and float32: the CUDA run is the CPU run within the golden bounds.
TEST_P(CudaGoldenTest, MatchesTheCpu) {
  for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
    SCOPED_TRACE(dtype == DType::kFloat64 ? "float64" : "float32");
    const double tol = testing::GoldenTolerance(dtype);
    const double param_tol =
        dtype == DType::kFloat32 ? testing::kFp32AdamParamTolerance : tol;
    Trained want, got;
    ASSERT_NO_FATAL_FAILURE(TrainBoth(dtype, want, got));
    ASSERT_EQ(got.calls.size(), want.calls.size());
    for (size_t i = 0; i < got.calls.size(); ++i) {
      testing::ExpectSameCall(got.calls[i], want.calls[i], tol);
    }
    ASSERT_EQ(got.gradients.size(), want.gradients.size());
    for (size_t i = 0; i < got.gradients.size(); ++i) {
      EXPECT_LT(RelativeDiff(got.gradients[i], want.gradients[i]), tol) << i;
    }
    OptimStepArgs step;
    step.max_grad_norm = kMaxGradNorm;
    testing::ExpectSameStep(got.step, want.step, step, tol);
    ASSERT_EQ(got.parameters.size(), want.parameters.size());
    for (size_t i = 0; i < got.parameters.size(); ++i) {
      EXPECT_LT(RelativeDiff(got.parameters[i], want.parameters[i]), param_tol)
          << i;
    }
    // Fresh ids for the next dtype.
    for (Engine* e : {cpu_.get(), cuda_.get()}) {
      ASSERT_TRUE(e->DeleteModel(GetParam().name).ok());
    }
  }
}

// Largest relative distance of `a`'s tensors to `b`'s.
double Distance(const std::vector<torch::Tensor>& a,
                const std::vector<torch::Tensor>& b) {
  double most = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    most = std::max(most, RelativeDiff(a[i], b[i]));
  }
  return most;
}

// bf16: the CUDA bf16 run is no farther from the CPU float32 run than the
// CPU's own bf16 run is, up to the mixed-precision contract's slack.
TEST_P(CudaGoldenTest, Bf16IsAsCloseToFloat32AsOnTheCpu) {
  if (GetParam().moe) GTEST_SKIP() << "bf16 is not implemented for MoE";
  constexpr double kSlack = 1.0;  // distances may be up to 2x the CPU's
  Trained cpu_f32, cuda_f32_unused;
  ASSERT_NO_FATAL_FAILURE(TrainBoth(DType::kFloat32, cpu_f32, cuda_f32_unused));
  for (Engine* e : {cpu_.get(), cuda_.get()}) {
    ASSERT_TRUE(e->DeleteModel(GetParam().name).ok());
  }
  Trained cpu_bf16, cuda_bf16;
  ASSERT_NO_FATAL_FAILURE(TrainBoth(DType::kBFloat16, cpu_bf16, cuda_bf16));
  const double cpu_grad = Distance(cpu_bf16.gradients, cpu_f32.gradients);
  const double cuda_grad = Distance(cuda_bf16.gradients, cpu_f32.gradients);
  const double cpu_param = Distance(cpu_bf16.parameters, cpu_f32.parameters);
  const double cuda_param = Distance(cuda_bf16.parameters, cpu_f32.parameters);
  RecordProperty("bf16_grad_distance_cpu", absl::StrCat(cpu_grad));
  RecordProperty("bf16_grad_distance_cuda", absl::StrCat(cuda_grad));
  EXPECT_GT(cpu_grad, 0) << "bf16 computed in float32?";
  EXPECT_LE(cuda_grad, cpu_grad * (1 + kSlack));
  EXPECT_LE(cuda_param, cpu_param * (1 + kSlack));
}

INSTANTIATE_TEST_SUITE_P(
    Models, CudaGoldenTest,
    ::testing::Values(DeviceCase{"llama"}, DeviceCase{"qwen3", "qwen3"},
                      DeviceCase{"mixtral", nullptr, /*moe=*/true},
                      DeviceCase{"lora", nullptr, false, /*lora=*/true},
                      DeviceCase{"sample_mean", nullptr, false, false,
                                 "cross_entropy", LossReduction::kSampleMean},
                      DeviceCase{"importance_sampling", nullptr, false, false,
                                 "importance_sampling"},
                      DeviceCase{"ppo", nullptr, false, false, "ppo"},
                      DeviceCase{"cispo", nullptr, false, false, "cispo"},
                      DeviceCase{"dro", nullptr, false, false, "dro"}),
    [](const ::testing::TestParamInfo<DeviceCase>& info) {
      return std::string(info.param.name);
    });

// Meshes of GPUs, one rank process per GPU (cuda:<local rank>, NCCL for
// every data group), against the single CPU reference in each rank: fp64
// losses, gradient shards, norm and updated shards to 1e-10. Skipped where
// fewer GPUs than ranks are visible.
struct GpuMesh {
  const char* name;
  MeshShape shape;
};

MeshShape GpuShape(int dp_shard, int tp) {
  MeshShape shape;
  shape.dp_shard = dp_shard;
  shape.tp = tp;
  return shape;
}

class CudaMeshGoldenTest : public ::testing::TestWithParam<GpuMesh> {};

TEST_P(CudaMeshGoldenTest, MatchesOneCpuDevice) {
  const MeshShape& shape = GetParam().shape;
  if (auto reason = MissingCuda()) GTEST_SKIP() << *reason;
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  if (gpus < shape.world_size()) {
    GTEST_SKIP() << "needs " << shape.world_size() << " GPUs, " << gpus
                 << " visible";
  }
#if TALLY_WITH_NCCL
  InstallNcclCommunicators();
#endif
  EngineOptions on_gpus;
  on_gpus.device = torch::Device(torch::kCUDA, 0);  // each rank: its own
  const DeviceCase c{"llama"};
  const ModelSpec spec = CaseSpec(c, DType::kFloat64);
  const std::vector<ForwardBackwardArgs> calls = CaseCalls(c);
  testing::RunGoldenOnRanks(
      shape, on_gpus, EngineOptions(),
      [&](Engine& engine, Engine& reference, const RankEnv&) -> absl::Status {
        const double tol = testing::GoldenTolerance(DType::kFloat64);
        for (Engine* e : {&engine, &reference}) {
          TALLY_RETURN_IF_ERROR(e->CreateModel(spec).status());
        }
        for (const ForwardBackwardArgs& a : calls) {
          TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult got,
                                 engine.ForwardBackward(spec.model_id, a));
          TALLY_ASSIGN_OR_RETURN(ForwardBackwardResult want,
                                 reference.ForwardBackward(spec.model_id, a));
          testing::ExpectSameCall(got, want, tol);
        }
        TALLY_ASSIGN_OR_RETURN(CausalLm * model,
                               EngineTestPeer::Model(engine, spec.model_id));
        TALLY_ASSIGN_OR_RETURN(CausalLm * ref,
                               EngineTestPeer::Model(reference, spec.model_id));
        testing::ExpectGradientShards(*model, *ref, tol);
        OptimStepArgs step;
        step.max_grad_norm = kMaxGradNorm;
        TALLY_ASSIGN_OR_RETURN(OptimStepResult got,
                               engine.OptimStep(spec.model_id, step));
        TALLY_ASSIGN_OR_RETURN(OptimStepResult want,
                               reference.OptimStep(spec.model_id, step));
        testing::ExpectSameStep(got, want, step, tol);
        for (const Parameter& p : model->parameters()) {
          const Parameter* r = ref->Find(p.name);
          if (r == nullptr) return absl::InternalError(p.name);
          EXPECT_LT(RelativeDiff(p.tensor, model->LocalShard(p, r->tensor)),
                    tol)
              << p.name;
        }
        return absl::OkStatus();
      });
}

INSTANTIATE_TEST_SUITE_P(Meshes, CudaMeshGoldenTest,
                         ::testing::Values(GpuMesh{"dp_shard2", GpuShape(2, 1)},
                                           GpuMesh{"tp2", GpuShape(1, 2)},
                                           GpuMesh{"dp_shard2_tp2",
                                                   GpuShape(2, 2)}),
                         [](const ::testing::TestParamInfo<GpuMesh>& info) {
                           return std::string(info.param.name);
                         });

// Without CUDA, an engine on a CUDA device is refused up front with the
// reason, never at the first model.
TEST(CudaDeviceTest, AnUnusableDeviceIsRefusedAtCreation) {
  if (!MissingCuda()) GTEST_SKIP() << "a CUDA device is usable here";
  EngineOptions options;
  options.device = torch::Device(torch::kCUDA, 0);
  const absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::CreateSingleRank(options);
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kFailedPrecondition)
      << engine.status();
  EXPECT_NE(engine.status().message().find("cuda:0"), std::string::npos)
      << engine.status();
}

}  // namespace
}  // namespace tally
