// forkguard::Error — the root of every exception forkguard throws at its public API.
//
//   try { auto state = forkguard::probe::pid(1234); }
//   catch (const forkguard::Error& e) { std::cerr << e.what() << "\n"; }
//
// Messages name the object concerned (file, rank, PID, sample, CUDA call and its CUresult name).
// Thread-safety: exception objects are immutable after construction.
#pragma once

#include <stdexcept>
#include <string>

namespace forkguard {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A system call failed; the message names the call, the object and strerror(errno).
class SystemError : public Error {
 public:
  SystemError(const std::string& what_failed, int err);
  int error_code() const noexcept { return err_; }

 private:
  int err_;
};

}  // namespace forkguard
