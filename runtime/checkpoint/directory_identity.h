// DirectoryIdentity: a cheap identity of what a model directory holds, for
// what is kept in memory under a directory's path (the LoRA base every
// adapter created over one init_checkpoint shares). A directory published
// again at the same path (a later export or checkpoint over it) gets another
// identity, so it is read again instead of the copy in memory standing in
// for contents it no longer matches.
//
// A tally checkpoint or weights export lists the SHA-256 of every file in
// checksums.sha256, and every read verifies the files against that list: its
// identity is the list's own SHA-256. A directory without one (an HF
// download) is identified by its config.json bytes and the name and size of
// every file in it (not modification times, which differ between the copies
// of a download on different hosts): weights rewritten in place at the same
// sizes under the same config are taken for the base already in memory.
// Either way a small file or two and a listing are read, never the weights.
//
//   const std::string key = tally::CurrentBaseKey(spec);  // before reading
//   ... read spec.init_checkpoint ...
//   if (tally::CurrentBaseKey(spec) != key) ... it changed meanwhile
#ifndef TALLY_RUNTIME_CHECKPOINT_DIRECTORY_IDENTITY_H_
#define TALLY_RUNTIME_CHECKPOINT_DIRECTORY_IDENTITY_H_

#include <string>

#include "absl/status/status.h"
#include "runtime/checkpoint/checkpoint_manifest.h"
#include "runtime/config/types.h"
#include "runtime/parallel/communicator.h"

namespace tally {

// "sha256 <hex>" of the directory's published contents (PublishedDir), or
// "unreadable" when it cannot be listed or its identifying file read (the
// read that follows reports why).
std::string DirectoryIdentity(const std::string& dir);

// BaseKey(spec) with the DirectoryIdentity of spec.init_checkpoint as it is
// now (none without one): the key of the base a LoRA model created now
// builds or shares.
std::string CurrentBaseKey(const ModelSpec& spec);

// OK unless `manifest`, the tally.json of the LoRA adapter state at
// `state`, recorded a base_identity that `base_dir` (its base, as resolved
// for this server) no longer has: then FAILED_PRECONDITION naming the base,
// whose weights are not those the adapter was trained over.
absl::Status CheckAdapterBase(const CheckpointManifest& manifest,
                              const std::string& state,
                              const std::string& base_dir);

// Every rank of `world` returns ABORTED naming spec.init_checkpoint unless
// all of them computed the same `base_key` (each reads the directory's
// identity itself, so a publish between their reads parts them): no rank
// shares a base in memory while another builds a new one. One all-reduce
// for a LoRA model with an init_checkpoint on more than one rank; none
// otherwise (every other key is drawn from the spec alone).
absl::Status AgreeOnBaseKey(Communicator& world, const ModelSpec& spec,
                            const std::string& base_key);

}  // namespace tally

#endif  // TALLY_RUNTIME_CHECKPOINT_DIRECTORY_IDENTITY_H_
