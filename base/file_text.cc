#include "base/file_text.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/scoped_fd.h"

namespace tally {

absl::StatusOr<std::string> ReadFileUpTo(const std::string& path,
                                         uint64_t max_bytes,
                                         absl::StatusCode too_large) {
  // O_NONBLOCK: opening a FIFO without a writer returns at once (to be
  // refused below) instead of blocking the server; reads of a regular file
  // ignore it.
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  }
  auto refuse = [&](uint64_t size, bool exact) {
    return absl::Status(too_large,
                        absl::StrCat(path, " is ", exact ? "" : "over ", size,
                                     " bytes, more than the ", max_bytes,
                                     "-byte limit for this file"));
  };
  struct stat info;
  if (::fstat(fd.get(), &info) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("stat ", path));
  }
  if (!S_ISREG(info.st_mode)) {
    return absl::Status(too_large,
                        absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t stated = static_cast<uint64_t>(info.st_size);
  if (stated > max_bytes) return refuse(stated, /*exact=*/true);
  // A file growing while it is read: at most one byte past the limit.
  const uint64_t cap =
      std::min<uint64_t>(max_bytes, std::numeric_limits<size_t>::max() - 1);
  // Read straight into the string: the buffer is on the heap, so this is
  // safe on a thread with a small stack (an HTTP server's, a scrape's).
  std::string text;
  text.reserve(std::min<uint64_t>(stated, cap));
  constexpr size_t kChunk = size_t{1} << 16;
  while (text.size() <= cap) {
    const size_t have = text.size();
    const size_t want = std::min<uint64_t>(kChunk, cap + 1 - have);
    text.resize(have + want);
    const ssize_t n = ::read(fd.get(), text.data() + have, want);
    const int error = errno;
    text.resize(have + static_cast<size_t>(std::max<ssize_t>(n, 0)));
    if (n < 0) {
      if (error == EINTR) continue;
      return absl::ErrnoToStatus(error, absl::StrCat("read ", path));
    }
    if (n == 0) return text;
  }
  return refuse(cap, /*exact=*/false);
}

absl::StatusOr<std::string> ReadFileText(const std::string& path,
                                         absl::string_view what) {
  absl::StatusOr<std::string> text =
      ReadFileUpTo(path, std::numeric_limits<uint64_t>::max());
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot read ", path));
  }
  return text;
}

}  // namespace tally
