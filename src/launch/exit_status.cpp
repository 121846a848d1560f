#include "forkguard/launch/exit_status.hpp"

#include <fmt/format.h>
#include <sys/wait.h>

#include <cstring>

namespace forkguard::launch {

ExitStatus ExitStatus::from_wait_status(int status) {
  if (WIFEXITED(status)) return exited(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return signaled(WTERMSIG(status), WCOREDUMP(status));
  return {};
}

int ExitStatus::wait_status() const {
  switch (kind) {
    case Kind::kExited: return (code & 0xff) << 8;
    case Kind::kSignaled: return (signal & 0x7f) | (core_dumped ? 0x80 : 0);
    case Kind::kNotStarted: break;
  }
  return 0xffff;  // "continued": neither exited nor signaled
}

int ExitStatus::shell_code() const {
  switch (kind) {
    case Kind::kExited: return code;
    case Kind::kSignaled: return 128 + signal;
    case Kind::kNotStarted: return 127;
  }
  return 1;
}

std::string ExitStatus::to_string() const {
  switch (kind) {
    case Kind::kExited: return fmt::format("exited with code {}", code);
    case Kind::kSignaled: {
      const char* abbrev = ::sigabbrev_np(signal);
      return fmt::format("killed by signal {}{}{}", signal,
                         abbrev != nullptr ? fmt::format(" (SIG{})", abbrev) : std::string(),
                         core_dumped ? " (core dumped)" : "");
    }
    case Kind::kNotStarted: return "not started";
  }
  return "unknown";
}

}  // namespace forkguard::launch
