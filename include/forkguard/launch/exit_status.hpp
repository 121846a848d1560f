// ExitStatus: how a process ended, as a value that prints itself.
//
//   ExitStatus::from_wait_status(status).to_string()  // "killed by signal 11 (SIGSEGV) (core
//   dumped)"
//
// Thread-safety: plain value.
#pragma once

#include <string>

namespace forkguard::launch {

struct ExitStatus {
  enum class Kind { kExited, kSignaled, kNotStarted };
  Kind kind = Kind::kNotStarted;
  int code = 0;    // exit code when kExited
  int signal = 0;  // when kSignaled
  bool core_dumped = false;

  static ExitStatus from_wait_status(int status);
  static ExitStatus exited(int code) { return {Kind::kExited, code, 0, false}; }
  static ExitStatus signaled(int sig, bool core = false) { return {Kind::kSignaled, 0, sig, core}; }

  // The inverse of from_wait_status: the wait status waitpid() gives for it (what the fork
  // server's "exit PID STATUS" report carries). kNotStarted gives a status that maps back to it.
  int wait_status() const;

  bool success() const { return kind == Kind::kExited && code == 0; }
  // The shell's convention: the code, or 128 + signal.
  int shell_code() const;
  std::string to_string() const;
};

}  // namespace forkguard::launch
