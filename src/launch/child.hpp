// child: the one place in forkguard that forks. Every process forkguard starts (a rank, the fork
// server and what it forks, a loader's guarded-fork worker, the traced program) is started by
// start_child(), which allocates everything before fork(), runs one async-signal-safe set-up in
// the child (signals, parent-death signal, process group, one fd plan) and hands back a Child: an
// RAII handle whose stop policy (terminate, grace, kill, reap) is data.
//
//   auto exec = prepare_exec({"sh", "-c", "echo hi"}, current_environment());
//   Child c = start_child({.exec = &exec, .stdout_fd = pipe_w, .reap_tree = true});
//   ExitStatus s = c.wait();   // or let it go: the destructor applies c's stop policy
//
// With `reap_tree`, the child is a tiny subreaper ("fg-reaper" in ps) that starts the real program
// (vfork and exec, as posix_spawn; a fork for a main function), mirrors its exit status, and kills
// every descendant that is left when the program exits or when the reaper's parent dies (kill -9
// included), setsid()'d ones too.
//
// Thread-safety: start_child may be called from any thread; a Child has one owner. Linux ties the
// parent-death signal to the thread that forks, so it is armed only for a fork by the main thread
// (and always for a reaper): see ChildOptions::parent_death_signal.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "detail/fd.hpp"
#include "forkguard/launch/entry.hpp"
#include "forkguard/launch/environment.hpp"
#include "forkguard/launch/exit_status.hpp"

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

// ---------------------------------------------------------------- the fd plan (pure)
// Make `from` (an fd of the parent) available as `to` in the child, close-on-exec or not.
struct FdMapping {
  int from = -1;
  int to = -1;
  bool cloexec = false;
};

struct FdStep {
  enum class Op { kDup, kSetFlags, kCloseRange };
  Op op = Op::kDup;
  int a = -1;            // kDup: from; kSetFlags: the fd; kCloseRange: first
  int b = -1;            // kDup: to;   kCloseRange: last (inclusive; -1: to the end)
  bool cloexec = false;  // kDup, kSetFlags
};

// Ordered steps that realize `mappings` whatever their overlaps and cycles (a target that is
// another mapping's source is first moved aside, above every fd named), then, with
// `close_others`, close every fd from 3 up that is not a target. stdio (0-2) is never closed: an
// unmapped one is inherited. Throws Error for two mappings to one target or a negative fd.
std::vector<FdStep> plan_fds(std::vector<FdMapping> mappings, bool close_others);

// ---------------------------------------------------------------- starting a child
struct ChildIo {
  int stdout_fd = -1;  // -1: inherit
  int stderr_fd = -1;
};

// What stops a Child that is destroyed while running, or asked to stop().
struct StopPolicy {
  int signal = SIGTERM;                        // first; 0 goes straight to SIGKILL
  std::chrono::milliseconds grace{5000};       // then SIGKILL after this long
  std::chrono::milliseconds kill_wait{30000};  // then reaped (the wait gives up after this)
};

enum class ProcessGroup {
  kInherit,  // stays in the parent's group (terminal signals reach it, as a shell job's)
  kNew,      // its own group, id = its PID: signal() reaches what it starts in that group
};

struct ChildOptions {
  const PreparedExec* exec = nullptr;  // exec this ...
  std::function<int()> main{};         // ... or run this in the child; its result is the exit code
  char** environ_for_main = nullptr;   // main only: `environ` in the child (nullptr: unchanged)
  int stdin_fd = -1;                   // -1: inherited
  int stdout_fd = -1;
  int stderr_fd = -1;
  std::vector<FdMapping> keep_fds{};  // more fds for the child, at given numbers
  bool close_other_fds = true;        // false: the child keeps what the parent had open
  std::vector<int> close_fds{};       // closed in the child anyway (with close_other_fds false)
  ProcessGroup group = ProcessGroup::kNew;
  // 0: none. Armed only when the parent's main thread forks (the kernel sends it when the forking
  // thread ends); a reaper (reap_tree) gets SIGTERM from any thread.
  int parent_death_signal = SIGKILL;
  const sigset_t* signal_mask = nullptr;  // the child's mask; nullptr: none blocked
  const char* name = nullptr;             // comm (15 characters) for ps; must outlive start_child
  bool reap_tree = false;                 // run under a subreaper that kills what is left
  bool await_start = true;                // false: call Child::await_start() (parallel execs)
  // false: a clone child that sends its parent no exit signal. A wait for any child (wait(),
  // waitpid(-1), Python's os.wait()) never finds it, so a program's reap-all loop ends with it
  // running; only this handle reaps it. For a main function in a single-threaded parent only (a
  // raw clone runs none of glibc's fork handlers); an exec makes any process a waitable child
  // again (the kernel resets its exit signal to SIGCHLD). Otherwise it is an ordinary child.
  bool waitable = true;
  StopPolicy stop{};   // what the destructor does with a running child
  std::string what{};  // names it in errors ("rank 3"); default: the exec path
};

class Child {
 public:
  Child() = default;
  Child(Child&& o) noexcept;
  Child& operator=(Child&& o) noexcept;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child();  // a running child: stop() by its policy (not in a fork's copy of the handle)

  pid_t pid() const noexcept { return pid_; }
  int pidfd() const noexcept { return pidfd_.get(); }  // readable once it exited
  bool running() const noexcept { return pid_ > 0 && !reaped_; }
  bool waitable() const noexcept { return waitable_; }  // false: a clone child (see ChildOptions)
  explicit operator bool() const noexcept { return pid_ > 0; }

  // start_child with await_start = false: waits until the exec happened; throws SpawnError
  // (127/126 semantics) and reaps the child when it failed.
  void await_start();
  // To its process group (kNew), else to the process; a reaper passes it on to the program.
  void signal(int sig) noexcept;
  // Reaps it if it has exited; nullopt while it runs.
  std::optional<ExitStatus> try_wait();
  // Waits up to `timeout` for it to exit (its pidfd), and reaps it if it did; nullopt while it
  // runs. For a bounded step of a caller's own stop sequence (the fork server's EOF, then kill).
  std::optional<ExitStatus> wait_for(std::chrono::milliseconds timeout);
  ExitStatus wait();
  // The stop policy: signal, grace, SIGKILL, reap. The status once reaped.
  ExitStatus stop();

 private:
  friend Child start_child(const ChildOptions&);
  ExitStatus reaped(ExitStatus s);  // adds the reaper's core flag, closes the handle
  pid_t pid_ = -1;
  pid_t owner_ = -1;  // the process that started it (its parent)
  UniqueFd pidfd_;
  UniqueFd report_;  // the child's reports: a failed step, the reaper's news
  bool reaped_ = false;
  bool own_group_ = false;
  bool reaper_ = false;
  bool start_pending_ = false;
  bool waitable_ = true;
  StopPolicy stop_;
  std::string what_;
  ExitStatus status_;
};

// Forks (the only fork() and clone in forkguard outside the trace library's interposers). Throws
// SpawnError: "failed to execute X: <errno>" (exit code 127/126) or "error preparing to execute
// X: <step>: <errno>", with the step and errno the child reported through a close-on-exec pipe.
Child start_child(const ChildOptions& options);

UniqueFd open_pidfd(pid_t pid);

// A process someone else started and reaps (a child of the Python fork server), held by a pidfd
// its parent opened before it could reap it and passed on (SCM_RIGHTS). The pidfd names that one
// process for good: once it has exited, signal() reaches nothing, even when its PID is another
// process's by then. Where only a PID is known, pidfd_open(PID) is no substitute: the process may
// have been reaped, and its PID reused, before the open.
//
//   ServerChild c(pid, std::move(pidfd_from_the_server));
//   c.signal(SIGTERM);   // false: it had exited, nothing was sent
//   c.exited();          // without reaping it (its parent does)
//
// Thread-safety: const members from any thread; one owner.
class ServerChild {
 public:
  ServerChild() = default;
  // Takes `pidfd`; throws Error when it is no pidfd, or that of another process than `pid`.
  ServerChild(pid_t pid, UniqueFd pidfd);

  pid_t pid() const noexcept { return pid_; }
  int pidfd() const noexcept { return pidfd_.get(); }  // readable once it exited
  explicit operator bool() const noexcept { return static_cast<bool>(pidfd_); }

  // Sends `sig` to the process unless it has exited; whether it was sent.
  bool signal(int sig) const noexcept;
  // To the process group it leads (a fork-server rank's), by id: a group id is not reused while
  // any member lives. Where there is no such group (yet), to the process, as signal() does.
  void signal_group(int sig) const noexcept;
  bool exited() const noexcept;

 private:
  pid_t pid_ = -1;
  UniqueFd pidfd_;
};

}  // namespace forkguard::launch::detail
