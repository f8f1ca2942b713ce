#include "runtime/checkpoint/directory_identity.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <system_error>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/io/atomic_directory.h"
#include "runtime/io/safetensors.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

constexpr char kUnreadable[] = "unreadable";

// What identifies a directory without a checksum list: its config.json's
// SHA-256 and a "<name> <size>" line per file, sorted. Not modification
// times: ranks on different hosts each read their own copy of a download,
// and must compute the same identity for it.
absl::StatusOr<std::string> DescribeUnlisted(const fs::path& dir) {
  absl::StatusOr<std::string> config = Sha256OfFile(dir / kConfigFile);
  if (!config.ok()) return config.status();
  std::vector<std::string> files;
  std::error_code error;
  fs::directory_iterator it(dir, error);
  for (; !error && it != fs::directory_iterator(); it.increment(error)) {
    if (!it->is_regular_file(error) || error) continue;
    const uintmax_t size = it->file_size(error);
    if (error) break;
    files.push_back(absl::StrCat(it->path().filename().string(), " ", size));
  }
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("list ", dir.string(), ": ", error.message()));
  }
  std::sort(files.begin(), files.end());
  return absl::StrCat("config ", *config, "\n", absl::StrJoin(files, "\n"));
}

}  // namespace

std::string DirectoryIdentity(const std::string& dir) {
  const fs::path published = PublishedDir(dir);
  absl::StatusOr<std::string> digest =
      Sha256OfFile((published / kChecksumFile).string());
  if (!digest.ok()) {
    absl::StatusOr<std::string> described = DescribeUnlisted(published);
    if (!described.ok()) return kUnreadable;
    digest = Sha256OfBytes(*described);
    if (!digest.ok()) return kUnreadable;
  }
  return absl::StrCat("sha256 ", *digest);
}

std::string CurrentBaseKey(const ModelSpec& spec) {
  if (!spec.lora.enabled() || spec.init_checkpoint.empty()) {
    return BaseKey(spec, "");
  }
  return BaseKey(spec, DirectoryIdentity(spec.init_checkpoint));
}

absl::Status CheckAdapterBase(const CheckpointManifest& manifest,
                              const std::string& state,
                              const std::string& base_dir) {
  if (manifest.base_identity.empty()) return absl::OkStatus();
  const std::string now = DirectoryIdentity(base_dir);
  if (now == manifest.base_identity) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the LoRA base ", base_dir, " of adapter state ", state,
      " no longer holds the weights the adapter was trained over (identity ",
      manifest.base_identity, " at save, ", now,
      " now): restore that base, or create the model with init_checkpoint "
      "set to a base and lora.init_adapter ",
      state));
}

absl::Status AgreeOnBaseKey(Communicator& world, const ModelSpec& spec,
                            const std::string& base_key) {
  // The other keys are drawn from the spec alone, the same on every rank.
  if (world.size() == 1 || !spec.lora.enabled() ||
      spec.init_checkpoint.empty()) {
    return absl::OkStatus();
  }
  // The key's hash in two exact 32-bit halves: max(h) == -max(-h) on every
  // half exactly when every rank holds the same h.
  const uint64_t hash = std::hash<std::string>()(base_key);
  const double high = static_cast<double>(hash >> 32);
  const double low = static_cast<double>(hash & 0xffffffffu);
  torch::Tensor halves =
      torch::tensor({high, low, -high, -low}, torch::kFloat64);
  TALLY_RETURN_IF_ERROR(world.AllReduce(halves, ReduceOp::kMax));
  const auto agreed = halves.accessor<double, 1>();
  if (agreed[0] == -agreed[2] && agreed[1] == -agreed[3]) {
    return absl::OkStatus();
  }
  return absl::AbortedError(absl::StrCat(
      "init_checkpoint ", spec.init_checkpoint,
      " changed while the ranks read it (they would build their LoRA base "
      "from different contents); nothing was created: retry"));
}

}  // namespace tally
