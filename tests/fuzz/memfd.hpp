// The fuzzer's bytes as a file, for parsers that take a path: a memfd named by /proc/self/fd/N,
// rewritten for each input (no disk, no cleanup).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace forkguard::fuzz {

class MemFile {
 public:
  MemFile() : fd_(::memfd_create("forkguard-fuzz", MFD_CLOEXEC)) {
    if (fd_ < 0) std::abort();
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  // Replaces the contents; returns the path that opens them.
  std::string set(const uint8_t* data, size_t size) {
    if (::ftruncate(fd_, 0) != 0) std::abort();
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
    return "/proc/self/fd/" + std::to_string(fd_);
  }

 private:
  int fd_;
};

}  // namespace forkguard::fuzz
