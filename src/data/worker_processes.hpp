// The worker processes of one loader, whatever a job is to it: forkguard.DataLoader's job queue
// (data/job_workers.cpp) and the image loader's process workers (data/process_workers.cpp) keep
// their own messages and slots, and leave their processes to this pool. Each worker is started by
// a guarded fork of this process (start_worker, data/worker_sockets.hpp: under the sockets'
// registry lock) or by a fork server (a `call`), with one socket to its loader and a handle that
// names it for good: its Child, or the pidfd its fork server opened (ServerChild). The pool waits
// for each worker's first reply ("ready" or "failed", with a start timeout), notices a death (EOF
// on its socket: its exit status is collected, or it is killed after a grace and then collected),
// says how a worker ended ("killed by signal 9 (SIGKILL)", "died with its fork server: ..."), and
// stops them all (EOF, a grace, SIGKILL).
//
//   WorkerProcesses procs(2, ForkServer::get());   // nullptr: forks only
//   procs.start_call(0, "forkguard.data.worker");  // then procs.send_setup(0, bytes, memfd)
//   procs.start_fork(1, {.close_other_fds = false, .name = "w-1"}, [&](int sock) { ... });
//   std::string why = procs.await_all_ready<Reply>(timeout, "worker reply", texts);
//   auto r = procs.receive(deadline);  // a message, a worker that ended, or the deadline
//   procs.stop();
//
// Thread-safety: one thread drives a pool.
#pragma once

#include <fmt/format.h>
#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "data/worker_protocol.hpp"
#include "data/worker_sockets.hpp"
#include "detail/fd.hpp"
#include "detail/message_fields.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/launch/exit_status.hpp"
#include "launch/child.hpp"

namespace forkguard::launch::detail {
class ForkServer;
}

namespace forkguard::data::detail {

// What a loader says of a worker that did not say "ready" (its "failed" message speaks for itself).
struct NotReadyTexts {
  std::string not_running{};  // it was not running when the wait began
  std::string timeout{};      // no reply within the start timeout
  std::string other{};        // it answered with a message that is neither "ready" nor "failed"
  // It closed its socket (it ended; its exit collected with the grace where it came).
  std::function<std::string(int worker)> closed{};
};

class WorkerProcesses {
 public:
  using Clock = std::chrono::steady_clock;

  // `server`: the fork server start_call() uses (nullptr: start_fork() only).
  WorkerProcesses(int workers, launch::detail::ForkServer* server);
  ~WorkerProcesses();  // stop()
  WorkerProcesses(const WorkerProcesses&) = delete;
  WorkerProcesses& operator=(const WorkerProcesses&) = delete;

  int size() const noexcept { return static_cast<int>(procs_.size()); }

  // Worker `w` from the fork server, running its function `function` on its end of a new socket;
  // a worker of the pool from here on (stop() closes its socket). Throws what
  // ForkServer::start_call throws (a refusal, a reply without the child's pidfd).
  void start_call(int w, const std::string& function);
  // The setup message (SetupMessage: `bytes`, the worker's id) with `fd` (a memfd). Returns 0, or
  // the errno of a failed send.
  int send_setup(int w, size_t bytes, int fd);
  // Worker `w` as a guarded fork of this process (start_worker): `main(sock)` runs in the child on
  // its end of a new socket, and its result is the exit code. `before_fork` and
  // `after_fork_parent` (optional) are called around the fork in this process (the latter also
  // when it fails); `options.main` is set here. Throws what start_child throws.
  void start_fork(int w, launch::detail::ChildOptions options, std::function<int(int sock)> main,
                  const std::function<void()>& before_fork = {},
                  const std::function<void()>& after_fork_parent = {});

  // Waits for every worker's first reply, all within `timeout` (0: as long as it takes): "" when
  // each said "ready", else "worker W (PID P): why; ..." for each that did not. `Reply` is the
  // loader's std::variant of replies (ReadyReply and FailedReply among them), decoded as
  // `protocol`.
  template <class Reply>
  std::string await_all_ready(std::chrono::milliseconds timeout, std::string_view protocol,
                              const NotReadyTexts& say);

  // One message from a live worker, polled in order from worker `first` on (a loader that rotates
  // it starves none); a worker found closed is ended (end()) and reported.
  struct Received {
    enum class Kind {
      kMessage,  // `fields` from `worker`, with `fd` (the first fd it sent; the others are closed)
      kEnded,    // `worker` closed its socket: it has ended (how(worker))
      kTimeout,  // the deadline passed first
      kNone,     // no worker is alive
    };
    Kind kind = Kind::kNone;
    int worker = -1;
    std::vector<std::string> fields{};
    forkguard::detail::UniqueFd fd{};
  };
  Received receive(std::optional<Clock::time_point> deadline, size_t first = 0);

  // Worker `w` is done with: its socket closed, its exit collected within the grace, else it is
  // killed and collected.
  void end(int w);
  // Every worker: EOF on its socket (it finishes what it is doing and exits), then SIGKILL after
  // the grace (`now`: at once); each is collected.
  void stop(bool now = false);
  // The fork server is no longer this pool's to use (after stop(): its owner may close it).
  void detach_server() noexcept { server_ = nullptr; }

  // Through its handle only (its Child, to its process group; or its fork server's pidfd):
  // nothing once it has exited, never a process that has its PID by then.
  void signal(int w, int sig);
  // Waits up to `timeout` for its exit status (its fork server's report, or reaping our own
  // child); whether it is known now (or will never be: its fork server ended).
  bool collect(int w, std::chrono::milliseconds timeout);

  pid_t pid(int w) const { return procs_[static_cast<size_t>(w)].pid; }
  bool alive(int w) const { return procs_[static_cast<size_t>(w)].alive; }  // not known to end
  int socket(int w) const { return procs_[static_cast<size_t>(w)].sock.get(); }
  // Its exit status once collected ("not started": it was not ours to reap any more).
  const std::optional<launch::ExitStatus>& status(int w) const {
    return procs_[static_cast<size_t>(w)].status;
  }
  // Its fork server ended, and it with it (no status comes): how the server ended; else "".
  const std::string& lost(int w) const { return procs_[static_cast<size_t>(w)].lost; }
  // "exited with code 3", "killed by signal 9 (SIGKILL)", "died with its fork server: ...", or
  // "stopped (exit status unknown)".
  std::string how(int w) const;
  std::vector<pid_t> alive_pids() const;
  std::vector<pid_t> pids_without_status() const;  // started, no exit status collected

 private:
  struct Proc {
    pid_t pid = -1;
    WorkerSocket sock;
    launch::detail::Child child;               // a guarded fork's: ours until reaped
    launch::detail::ServerChild server_child;  // a fork server's child: its pidfd, if sent
    bool alive = false;                        // started, not known to have ended
    std::optional<launch::ExitStatus> status;  // once collected
    std::string lost;                          // its fork server ended: no status comes
  };
  struct FirstReply {
    enum class Kind { kMessage, kNotRunning, kTimeout, kClosed };
    Kind kind = Kind::kMessage;
    std::vector<std::string> fields{};
  };
  FirstReply first_reply(int w, std::optional<Clock::time_point> deadline);
  void started(int w, WorkerSocket sock);

  launch::detail::ForkServer* server_;
  std::vector<Proc> procs_;
};

[[noreturn]] void raise_data_error(const std::string& message);

template <class Reply>
std::string WorkerProcesses::await_all_ready(std::chrono::milliseconds timeout,
                                             std::string_view protocol, const NotReadyTexts& say) {
  const auto deadline = timeout.count() > 0 ? std::optional(Clock::now() + timeout) : std::nullopt;
  auto why_not = [&](int w) -> std::string {
    auto first = first_reply(w, deadline);
    switch (first.kind) {
      case FirstReply::Kind::kNotRunning: return say.not_running;
      case FirstReply::Kind::kTimeout: return say.timeout;
      case FirstReply::Kind::kClosed: return say.closed(w);
      case FirstReply::Kind::kMessage: break;
    }
    try {
      const auto reply =
          forkguard::detail::decode_one_of<Reply>(first.fields, protocol, &raise_data_error);
      if (std::holds_alternative<ReadyReply>(reply)) return {};
      if (const auto* failed = std::get_if<FailedReply>(&reply)) return failed->message;
      return say.other;
    } catch (const DataError& e) {
      return e.what();
    }
  };
  std::string failures;
  for (int w = 0; w < size(); ++w) {
    std::string why = why_not(w);
    if (!why.empty()) {
      failures +=
          fmt::format("{}worker {} (PID {}): {}", failures.empty() ? "" : "; ", w, pid(w), why);
    }
  }
  return failures;
}

}  // namespace forkguard::data::detail
