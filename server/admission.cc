#include "server/admission.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/error_reason.h"
#include "base/file_text.h"

namespace tally {
namespace {

std::string Gib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g GiB", bytes / (1u << 30));
  return text;
}

// /proc/meminfo's MemTotal in bytes; 0 when unreadable.
double MachineMemoryBytes() {
  const absl::StatusOr<std::string> text =
      ReadFileUpTo("/proc/meminfo", kMaxSystemFileBytes);
  if (!text.ok()) return 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    double kib = 0;
    if (absl::ConsumePrefix(&line, "MemTotal:") &&
        absl::SimpleAtod(
            absl::StripSuffix(absl::StripAsciiWhitespace(line), " kB"), &kib)) {
      return kib * 1024;
    }
  }
  return 0;
}

// A cgroup memory limit in bytes; 0 when absent or "max".
double CgroupLimitBytes(const char* path) {
  const absl::StatusOr<std::string> text =
      ReadFileUpTo(path, kMaxSystemFileBytes);
  double bytes = 0;
  return text.ok() &&
                 absl::SimpleAtod(absl::StripAsciiWhitespace(*text), &bytes)
             ? bytes
             : 0;
}

}  // namespace

absl::Status MemoryAdmission::CheckModel(const std::string& tenant,
                                         double bytes) const {
  absl::MutexLock lock(&mu_);
  return Report(ModelShortfall(
                    tenant, bytes,
                    "the model (parameters, gradients, optimizer state) needs"),
                "model");
}

absl::Status MemoryAdmission::CheckSnapshot(const std::string& tenant,
                                            double bytes) const {
  absl::MutexLock lock(&mu_);
  return Report(ModelShortfall(tenant, bytes,
                               "the sampler snapshot (its copy of the "
                               "weights) needs"),
                "model");
}

absl::Status MemoryAdmission::CheckCall(double bytes) const {
  absl::MutexLock lock(&mu_);
  return Report(CallShortfall(bytes), "call");
}

absl::Status MemoryAdmission::Report(absl::Status status,
                                     const char* what) const {
  if (!status.ok() && options_.on_refusal) options_.on_refusal(what);
  return status;
}

void MemoryAdmission::ReportResident() const {
  if (options_.on_resident) options_.on_resident(total_);
}

absl::Status MemoryAdmission::ModelShortfall(const std::string& tenant,
                                             double bytes,
                                             const char* needs) const {
  if (options_.limit_bytes > 0 && total_ + bytes > options_.limit_bytes) {
    return ReasonError(
        ErrorReason::kMemoryLimit,
        absl::StrCat(needs, " an estimated ", Gib(bytes), " per rank, and ",
                     Gib(std::max(0.0, options_.limit_bytes - total_)),
                     " of the ", Gib(options_.limit_bytes), " of ",
                     options_.limit_name, " are left; nothing was allocated"));
  }
  if (!tenant.empty() && options_.per_tenant_bytes > 0 &&
      TenantBytes(tenant) + bytes > options_.per_tenant_bytes) {
    return ReasonError(
        ErrorReason::kMemoryLimit,
        absl::StrCat(
            needs, " an estimated ", Gib(bytes), " per rank, and ",
            Gib(std::max(0.0, options_.per_tenant_bytes - TenantBytes(tenant))),
            " of this tenant's ", Gib(options_.per_tenant_bytes),
            " (--max-memory-bytes-per-tenant) are left; nothing was "
            "allocated"));
  }
  return absl::OkStatus();
}

void MemoryAdmission::Add(const std::string& model_id,
                          const std::string& tenant, double bytes) {
  absl::MutexLock lock(&mu_);
  Held& held = models_[model_id];
  total_ += bytes - held.bytes;
  held = {tenant, bytes};
  ReportResident();
}

void MemoryAdmission::Remove(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model_id);
  if (it == models_.end()) return;
  total_ -= it->second.bytes;
  models_.erase(it);
  ReportResident();
}

absl::Status MemoryAdmission::CallShortfall(double bytes) const {
  if (options_.limit_bytes <= 0 || total_ + bytes <= options_.limit_bytes) {
    return absl::OkStatus();
  }
  return ReasonError(
      ErrorReason::kMemoryLimit,
      absl::StrCat(
          "the call's activations need an estimated ", Gib(bytes),
          " per rank, and the models leave ",
          Gib(std::max(0.0, options_.limit_bytes - total_)), " of the ",
          Gib(options_.limit_bytes), " of ", options_.limit_name,
          "; nothing was executed: send fewer or shorter samples per call"));
}

double MemoryAdmission::resident_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

double MemoryAdmission::TenantBytes(const std::string& tenant) const {
  double bytes = 0;
  for (const auto& [id, held] : models_) {
    if (held.tenant == tenant) bytes += held.bytes;
  }
  return bytes;
}

double SamplerSnapshotBytes(const ModelSummary& model, int dp_shard,
                            ZeroStage zero) {
  const double element = MasterDType(model.dtype) == DType::kFloat64 ? 8 : 4;
  const double whole =
      model.lora.enabled()
          ? static_cast<double>(model.trainable_bytes)
          : static_cast<double>(model.num_parameters) * element;
  const double shards = std::max(dp_shard, 1);
  if (shards == 1) return whole;
  return whole / shards + (zero == ZeroStage::kParameters ? 0 : whole);
}

int64_t DefaultMemoryLimitBytes(int local_ranks) {
  double memory = MachineMemoryBytes();
  for (double cgroup :
       {CgroupLimitBytes("/sys/fs/cgroup/memory.max"),
        CgroupLimitBytes("/sys/fs/cgroup/memory/memory.limit_in_bytes")}) {
    if (cgroup > 0 && (memory <= 0 || cgroup < memory)) memory = cgroup;
  }
  return static_cast<int64_t>(0.8 * memory / std::max(local_ranks, 1));
}

MemoryLimit DeviceMemoryLimit(const DeviceMemorySnapshot& memory,
                              int64_t flag_bytes) {
  const double cached =
      std::max(0.0, memory.reserved_bytes - memory.allocated_bytes);
  const double margin =
      std::max(kDeviceMarginBytes, kDeviceMarginFraction * memory.total_bytes);
  const double budget = std::max(0.0, memory.free_bytes + cached - margin);
  if (flag_bytes > 0 && static_cast<double>(flag_bytes) < budget) {
    return {static_cast<double>(flag_bytes), "--max-memory-bytes"};
  }
  return {budget,
          absl::StrCat(memory.device, "'s memory (", Gib(memory.free_bytes),
                       " free at start + ", Gib(cached),
                       " cached by the allocator - ", Gib(margin),
                       " margin, of ", Gib(memory.total_bytes), ")")};
}

}  // namespace tally
