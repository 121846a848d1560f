// Holds a process of the test driver in the middle of cuInit (FAKE_CUDA_INIT_GATE, see
// fake_cuda/fake_common.hpp): its device files open, its driver thread not yet started.
//
//   ft::CuInitGate gate(dir.path());
//   ft::Interactive h({ft::kCudaStage}, gate.env(ft::fake_cuda_env(dir.path())));
//   h.send("init");
//   gate.wait_until_held();   // returns once cuInit is there
//   ... inspect h.pid() ...
//   gate.release();           // cuInit goes on; h answers "ok"
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "process.hpp"

namespace forkguard::testing {

class CuInitGate {
 public:
  explicit CuInitGate(const std::string& dir) : path_(dir + "/cuinit.gate") {
    if (::mkfifo(path_.c_str(), 0600) != 0) {
      throw std::runtime_error("mkfifo " + path_ + ": " + std::strerror(errno));
    }
  }
  ~CuInitGate() { release(); }
  CuInitGate(const CuInitGate&) = delete;
  CuInitGate& operator=(const CuInitGate&) = delete;

  EnvOverrides env(EnvOverrides base) const {
    base["FAKE_CUDA_INIT_GATE"] = path_;
    return base;
  }
  // The FIFO's open for writing completes when cuInit opens it for reading: no polling.
  void wait_until_held() {
    writer_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
    if (writer_ < 0) throw std::runtime_error("open " + path_ + ": " + std::strerror(errno));
  }
  void release() {
    if (writer_ >= 0) ::close(writer_);
    writer_ = -1;
  }

 private:
  std::string path_;
  int writer_ = -1;
};

}  // namespace forkguard::testing
