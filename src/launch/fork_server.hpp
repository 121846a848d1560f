// The fork server (zygote): a process forked by forkguard::init() while the program is still
// clean, which forks ranks on request. Driven over a SOCK_SEQPACKET socketpair (no path anyone
// else can connect to); the ranks' stdout/stderr travel with each request by SCM_RIGHTS. It
// re-probes itself before every fork, reaps its children and reports each exit status. One found
// dead at a request is reaped and replaced by a new fork of the program (if still CUDA-clean).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "detail/fd.hpp"
#include "forkguard/launch/entry.hpp"
#include "launch/child.hpp"
#include "launch/zygote_protocol.hpp"

namespace forkguard::launch::detail {

class ForkServer {
 public:
  // The server init() started, or nullptr.
  static ForkServer* get();
  // Forks the zygote: called by init(), and by the Python package (at import, in a rank of
  // notebook_launch's server). Nothing where there is one.
  static void start();
  // Closes this process's zygote's socket (it exits) and reaps it; after it get() is nullptr.
  // Run at exit; the Python server's ranks, which leave by _exit, call it first.
  static void stop();
  // A fork server someone else started that speaks the same protocol (notebook_launch's Python
  // interpreter server, python/forkguard/_server.py): `sock` is duplicated, the caller keeps its
  // own. One object per server in this process, shared by whoever attaches while it lives (a
  // DataLoader, notebook_launch, forkguard.guard()): the socket has one reader, so an exit
  // report or a reply is never taken by one user from another. A dead one is not replaced: a
  // request then throws SpawnError.
  static std::shared_ptr<ForkServer> attach(pid_t pid, int sock);

  // Asks the zygote to fork a rank running `entry`, or to fork+exec argv; `env` is the complete
  // environment ("K=V"). Returns the rank; throws SpawnError with the zygote's reason.
  // `extra_fd` (optional) travels with an entry request as the rank's third fd.
  ServerChild start_entry(const std::string& entry, const RankContext& ctx,
                          const std::vector<std::string>& env, int stdout_fd, int stderr_fd,
                          int extra_fd = -1);
  ServerChild start_exec(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                         int stdout_fd, int stderr_fd);

  // Asks the zygote to fork a child running the zygote function `function` on `fd` (passed to
  // the child; every other fd but stdio is closed there). The child _exits with its result.
  ServerChild start_call(const std::string& function, int fd, int stdout_fd = -1,
                         int stderr_fd = -1);

  int fd() const { return sock_.get(); }
  int pidfd() const { return zygote_.pidfd(); }  // the zygote's (-1 when attached)
  pid_t pid() const { return pid_; }
  // Exit reports received so far (PID, wait status) for the PIDs `mine` claims; reads what is
  // pending without blocking. Reports nobody has claimed yet stay queued.
  std::vector<std::pair<pid_t, int>> take_exits(const std::function<bool(pid_t)>& mine);
  // Waits up to `timeout` for the exit report of `pid`; its wait status, or nullopt. Throws
  // SpawnError naming the server and how it ended (ended()) once its socket is closed and no
  // report of `pid` is queued: none will come (its children die with it, PR_SET_PDEATHSIG).
  std::optional<int> wait_exit(pid_t pid, std::chrono::milliseconds timeout);
  // Whether its socket was found closed (it exited, or is exiting).
  bool closed() const { return closed_; }
  // "the fork server (PID N) ended (killed by signal 9 (SIGKILL))": the status when it is this
  // process's child (the zygote; the interpreter server, _native.start_process), looked at
  // without reaping it (its owner does); "(its socket closed)" when it cannot be known.
  std::string ended();

  // Any request of the server's protocol (the Python server's "preload", "guard_start" with up to
  // kMaxSendFds fds) and the fields of the next message that is not an exit report (those are
  // queued meanwhile); nullopt when none came within `timeout` (none: as long as it takes). An
  // empty `fields` sends nothing and only waits (the server's "ready"). Throws SpawnError once
  // the server closed its socket, saying how it ended (ended()). `reply_fd` (optional): the fd
  // the reply carried, if any (a `started` reply carries the child's pidfd).
  std::optional<std::vector<std::string>> exchange(const std::vector<std::string>& fields,
                                                   const std::vector<int>& fds,
                                                   std::optional<std::chrono::milliseconds> timeout,
                                                   forkguard::detail::UniqueFd* reply_fd = nullptr);

 private:
  ForkServer(pid_t pid, int sock) : pid_(pid), sock_(sock) {}
  ServerChild request(const std::vector<std::string>& fields, int stdout_fd, int stderr_fd,
                      int extra_fd = -1);
  bool read_one(bool block);  // one message: exit reports are queued, a reply is stored
  // The zygote's socket is closed: reaps it and forks a new one (said on stderr; the notice is
  // returned), or throws SpawnError saying why it cannot (not the owner, CUDA state here).
  std::string replace_dead_zygote();

  pid_t pid_;
  Child zygote_;  // the zygote this process started (none when attached); never destroyed
  forkguard::detail::UniqueFd sock_;
  bool attached_ = false;               // not ours to replace
  ForkServer* retired_next_ = nullptr;  // the list of stopped servers (stop())
  std::mutex mutex_;
  std::vector<std::pair<pid_t, int>> exits_;
  ZygoteReply reply_;
  std::vector<std::string> reply_fields_;  // the same reply as it came
  forkguard::detail::UniqueFd reply_fd_;   // the first fd it carried, if any
  bool have_reply_ = false;
  bool closed_ = false;  // recv found EOF
  std::string ended_;    // ended(), once known
};

// A function the zygote can fork a child for: registered at static-initialization time (so the
// zygote, a fork of the program, has it too), run with the fd sent with the request. The registry
// rule of detail/registry.hpp: a name registered twice keeps its first function (false, and a line
// on stderr naming both places).
using ZygoteFunction = int (*)(int fd);
bool register_zygote_function(const char* name, ZygoteFunction fn,
                              const char* file = __builtin_FILE(), int line = __builtin_LINE());
// The function registered as `name`, or nullptr; the message for a name nobody registered.
ZygoteFunction find_zygote_function(std::string_view name);
std::string unknown_zygote_function(std::string_view name);

}  // namespace forkguard::launch::detail
