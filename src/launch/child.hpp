// Starting one child process: everything it needs is prepared (allocated) before fork(); the
// child side is async-signal-safe until exec() or the entry function.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "detail/fd.hpp"
#include "forkguard/launch/entry.hpp"
#include "forkguard/launch/environment.hpp"

namespace forkguard::launch::detail {

using forkguard::detail::UniqueFd;

// argv and envp as NULL-terminated arrays, with their storage.
struct PreparedExec {
  std::string path;  // resolved executable (PATH searched before fork)
  std::vector<std::string> argv_storage;
  std::vector<std::string> env_storage;
  std::vector<char*> argv;
  std::vector<char*> envp;
};

// Throws SpawnError (exit code 127: not found, 126: not executable) unless `name` names, or PATH
// in `env` finds, a regular file this process may execute. Checked before any rank starts, so a
// typo fails the same way whatever the start method.
void check_executable(const std::string& name, const EnvMap& env);

// `env` is the complete environment of the child.
PreparedExec prepare_exec(const std::vector<std::string>& argv, const EnvMap& env);
std::vector<std::string> flatten(const EnvMap& env);
std::vector<char*> c_array(std::vector<std::string>& strings);

struct ChildIo {
  int stdout_fd = -1;  // -1: inherit
  int stderr_fd = -1;
};

struct StartedChild {
  pid_t pid = -1;
  UniqueFd pidfd;       // readable when the child exits; waitid(P_PIDFD) reaps it
  UniqueFd exec_check;  // begin_exec only: EOF once the exec happened, an errno if it failed
};

// ============ child side: no malloc, no locks, no exceptions from here ============
// Own process group, SIGKILL when the parent dies, stdio from io, every other fd closed
// (keep_fd excepted), signals unblocked and reset. Returns false if the parent is already gone.
bool child_setup(pid_t parent, const ChildIo& io, int keep_fd) noexcept;
// ===================================================================================

// fork + child_setup + execve. Throws SpawnError "failed to execute PATH: <errno text>" with the
// errno the child reported through a close-on-exec pipe.
StartedChild spawn_exec(const PreparedExec& exec, const ChildIo& io);
// The two halves of spawn_exec, so that several children exec in parallel: begin_exec forks,
// await_exec waits for the exec (or reaps the child and throws).
StartedChild begin_exec(const PreparedExec& exec, const ChildIo& io);
void await_exec(StartedChild& child, const std::string& path);

// fork + child_setup + fn(ctx) with `envp` as the environment; the child _exits with its result.
StartedChild fork_call(EntryFunction fn, const RankContext& ctx, char** envp, const ChildIo& io);

UniqueFd open_pidfd(pid_t pid);

// A watchdog process that outlives this one: it SIGKILLs the process groups it was told about
// when this process dies without saying goodbye (kill -9 included), so that what a rank started
// (a wrapper script's python) does not live on under PID 1 after the rank itself got its
// parent-death signal. One per launch; its post-fork loop lives in child.cpp with the rest.
// Limit: a descendant that left its rank's process group (setsid, setpgid) is not found.
class TreeGuard {
 public:
  TreeGuard();   // starts the watchdog (throws SpawnError when it cannot)
  ~TreeGuard();  // says goodbye (nothing is killed) and reaps it
  TreeGuard(const TreeGuard&) = delete;
  TreeGuard& operator=(const TreeGuard&) = delete;

  void watch(pid_t pgid) noexcept;   // a rank's group, as soon as the rank exists
  void forget(pid_t pgid) noexcept;  // once the launcher has killed and reaped that group
  pid_t pid() const noexcept { return pid_; }

 private:
  void send(int op, pid_t pgid) noexcept;
  pid_t pid_ = -1;
  UniqueFd to_guard_;
};

}  // namespace forkguard::launch::detail
