#include "runtime/model/lora.h"

#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/parallel/parallel_ops.h"

namespace tally {
namespace {

constexpr char kLoraA[] = ".lora_A.weight";
constexpr char kLoraB[] = ".lora_B.weight";

// "X.lora_A.weight" -> "X.weight".
std::string BaseWeightOf(const std::string& factor) {
  return absl::StrCat(factor.substr(0, factor.size() - sizeof(kLoraA) + 1),
                      ".weight");
}

void AddFactorSpecs(const std::string& module, const LoraTarget& target,
                    int64_t rank, bool held,
                    std::vector<ParameterSpec>& specs) {
  specs.push_back({absl::StrCat(module, kLoraA),
                   {rank, target.in_features},
                   ParameterInit::kKaimingUniform,
                   held});
  specs.push_back({absl::StrCat(module, kLoraB),
                   {target.out_features, rank},
                   ParameterInit::kZeros,
                   held});
}

}  // namespace

bool IsLoraParameter(const std::string& name) {
  return absl::EndsWith(name, kLoraA) || absl::EndsWith(name, kLoraB);
}

void AddLoraRules(ShardingPlan& plan) {
  const std::vector<PlanRule> rules = plan.rules;
  for (const PlanRule& rule : rules) {
    const bool column = rule.style == ParallelStyle::kColumnwise;
    if ((!column && rule.style != ParallelStyle::kRowwise) ||
        !absl::EndsWith(rule.pattern, ".weight")) {
      continue;
    }
    const std::string module =
        rule.pattern.substr(0, rule.pattern.size() - sizeof(".weight") + 1);
    plan.rules.push_back(
        {absl::StrCat(module, kLoraA),
         column ? ParallelStyle::kReplicate : ParallelStyle::kRowwise});
    plan.rules.push_back(
        {absl::StrCat(module, kLoraB),
         column ? ParallelStyle::kColumnwise : ParallelStyle::kReplicate});
  }
}

std::vector<ParameterSpec> LoraParameterSpecs(const LlamaConfig& config,
                                              const LoraConfig& lora,
                                              const LayerRange& held,
                                              bool last_stage) {
  std::vector<ParameterSpec> specs;
  if (!lora.enabled()) return specs;
  const std::vector<LoraTarget> targets = LoraLayerTargets(config, lora);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    for (const LoraTarget& target : targets) {
      AddFactorSpecs(absl::StrCat("model.layers.", i, ".", target.path), target,
                     lora.rank, i >= held.begin && i < held.end, specs);
    }
  }
  if (auto head = LoraUnembedTarget(config, lora)) {
    AddFactorSpecs(head->path, *head, lora.rank, last_stage, specs);
  }
  return specs;
}

torch::Tensor LoraDelta(const torch::Tensor& x, const torch::Tensor& a,
                        const torch::Tensor& b, double scaling) {
  return torch::linear(torch::linear(x, a), b) * scaling;
}

torch::Tensor ColumnParallelLoraDelta(const torch::Tensor& x,
                                      const torch::Tensor& a,
                                      const torch::Tensor& b, double scaling,
                                      Communicator& tp) {
  const torch::Tensor u =
      ColumnParallelLinear(x, a, torch::kFloat32, /*bias=*/{}, &tp);
  return ColumnParallelLinear(u, b, b.scalar_type()) * scaling;
}

torch::Tensor RowParallelLoraDelta(const torch::Tensor& x,
                                   const torch::Tensor& a,
                                   const torch::Tensor& b, double scaling,
                                   Communicator& tp) {
  const torch::Tensor u =
      ReduceFromTensorParallelRegion(RowParallelLinear(x, a), tp)
          .to(b.scalar_type());
  return torch::linear(u, b) * scaling;
}

absl::StatusOr<NamedTensors> MergeLora(NamedTensors weights, double scaling) {
  return CatchTorch("LoRA merge", [&]() -> absl::StatusOr<NamedTensors> {
    std::map<std::string, torch::Tensor> factors;
    NamedTensors out;
    std::map<std::string, size_t> position;
    for (auto& [name, t] : weights) {
      if (IsLoraParameter(name)) {
        factors[name] = t;
      } else {
        position[name] = out.size();
        out.emplace_back(name, t);
      }
    }
    for (const auto& [name, a] : factors) {
      if (!absl::EndsWith(name, kLoraA)) continue;
      const std::string module =
          name.substr(0, name.size() - sizeof(kLoraA) + 1);
      auto b = factors.find(absl::StrCat(module, kLoraB));
      const std::string base = BaseWeightOf(name);
      if (!position.count(base) && base == "lm_head.weight" &&
          position.count("model.embed_tokens.weight")) {
        // A tied model's head is its embedding, which the lookup must keep
        // as it was: the merged head becomes a weight of its own.
        position[base] = out.size();
        out.emplace_back(
            base, out[position["model.embed_tokens.weight"]].second.clone());
      }
      auto p = position.find(base);
      if (b == factors.end() || p == position.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("LoRA factor ", name,
                         " has no lora_B or base weight to merge into"));
      }
      torch::Tensor& w = out[p->second].second;
      w = w + torch::matmul(b->second, a) * scaling;
    }
    return out;
  });
}

std::string PeftAdapterConfig(const LoraConfig& lora,
                              const std::string& base_model) {
  nlohmann::ordered_json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model;
  j["r"] = lora.rank;
  j["lora_alpha"] = lora.alpha;
  j["lora_dropout"] = 0.0;
  j["target_modules"] = LoraTargetModules(lora);
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["modules_to_save"] = nullptr;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  return j.dump(2) + "\n";
}

}  // namespace tally
