// ScopedFd: a POSIX file descriptor closed when it goes out of scope, for the
// readers and writers that work on raw descriptors (base/file_text.cc,
// runtime/io/safetensors.cc).
//
//   tally::ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
//   if (fd.get() < 0) return ...;
//   ... ::read(fd.get(), ...) ...
//   if (fd.Close() != 0) return ...;  // a writer reports close's error
#ifndef TALLY_BASE_SCOPED_FD_H_
#define TALLY_BASE_SCOPED_FD_H_

#include <unistd.h>

namespace tally {

class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  // Closes now, reporting the error a deferred close would swallow.
  int Close() {
    const int result = ::close(fd_);
    fd_ = -1;
    return result;
  }

 private:
  int fd_;
};

}  // namespace tally

#endif  // TALLY_BASE_SCOPED_FD_H_
