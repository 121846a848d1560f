// Shared by the test driver's libcuda.so.1 and libnvidia-ml.so.1 (each compiles its own copy).
//
// Environment:
//   FAKE_CUDA_DEVICES   number of GPUs (default 2)
//   FAKE_CUDA_DEV_DIR   where the device files (nvidiactl, nvidia-uvm, nvidiaN) are created and
//                       opened (default $TMPDIR/forkguard-fake-cuda-dev)
//   FAKE_CUDA_LOG       file that gets one line per call: "<pid> <function> <result>"
//   FAKE_CUDA_COPY_DELAY_MS  async copies complete (and only then happen) this much later
//   FAKE_CUDA_INIT_GATE a FIFO: cuInit, once its device files are open and before its thread
//                       starts, opens it for reading and reads until a byte or end of file. A
//                       test's open(O_WRONLY) of the FIFO returns exactly when a process is held
//                       there (mid-cuInit); writing a byte or closing lets cuInit go on.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace fake_cuda {

inline int device_count() {
  const char* v = std::getenv("FAKE_CUDA_DEVICES");
  if (v == nullptr || *v == '\0') return 2;
  int n = std::atoi(v);
  return n < 0 ? 0 : (n > 64 ? 64 : n);
}

inline std::string dev_dir() {
  const char* v = std::getenv("FAKE_CUDA_DEV_DIR");
  if (v != nullptr && *v != '\0') return v;
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/forkguard-fake-cuda-dev";
}

// Opens (creating if needed) a device file of the given basename; -1 on failure.
inline int open_device(const char* name) {
  std::string dir = dev_dir();
  ::mkdir(dir.c_str(), 0777);  // EEXIST is fine
  std::string path = dir + "/" + name;
  return ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
}

// FAKE_CUDA_INIT_GATE (see above); returns at once when it is not set.
inline void wait_at_init_gate() {
  const char* path = std::getenv("FAKE_CUDA_INIT_GATE");
  if (path == nullptr || *path == '\0') return;
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  char byte = 0;
  while (::read(fd, &byte, 1) < 0 && errno == EINTR) {
  }
  ::close(fd);
}

// One write(2) per line with O_APPEND, so lines from concurrent processes never interleave.
inline void log_call(const char* function, int result) {
  const char* path = std::getenv("FAKE_CUDA_LOG");
  if (path == nullptr || *path == '\0') return;
  int saved = errno;
  int fd = ::open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
  if (fd >= 0) {
    char line[160];
    int n = std::snprintf(line, sizeof line, "%d %s %d\n", static_cast<int>(::getpid()), function,
                          result);
    if (n > 0) {
      ssize_t w = ::write(fd, line, static_cast<size_t>(n));
      (void)w;
    }
    ::close(fd);
  }
  errno = saved;
}

// Deterministic UUIDs, formatted like the real ones.
inline std::string uuid_of(int index) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "GPU-fa4e0000-0000-4000-8000-%012x", index);
  return buf;
}

}  // namespace fake_cuda
