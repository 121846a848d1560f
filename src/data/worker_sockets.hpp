// The sockets between loaders and their worker processes, for every worker pool of this process
// (the DataLoader's job queues, data/job_workers.hpp, and the image loader's process workers,
// data/workers.hpp), and the one way those pools fork a worker.
//
// A forked worker is a copy of this process and holds every fd open at its fork that it is not
// told to close. A worker holding another worker's socket keeps that worker from seeing EOF when
// its loader stops it (it waits out the 2 s grace and is killed), and keeps its loader from seeing
// EOF when it dies. So each such socket is registered from the moment it exists until it is closed,
// and a worker is forked with the registry's lock held from reading it to the fork: the child
// closes exactly the sockets open at its fork, its own aside, whichever pool or thread made them,
// and never a number another thread closed meanwhile and something else took again.
//
//   auto pair = make_worker_sockets();
//   Child c = start_worker({.main = ..., .close_other_fds = false}, pair.worker.get());
//   pair.worker.reset();  // the loader keeps pair.loader
//
// Thread-safety: any thread. start_worker holds the lock through the fork, so a hook that may let
// other threads run (Python's PyOS_BeforeFork runs the interpreter's at-fork handlers) is called
// before it, not inside. A process forked from this one (by anyone) starts with an empty registry
// of its own: the parent's sockets are not its to track, and its copy of the lock may be held by a
// thread that is not there.
#pragma once

#include <utility>

#include "launch/child.hpp"

namespace forkguard::data::detail {

struct WorkerSockets;

// One end of a worker's socket, registered while open. Move-only.
class WorkerSocket {
 public:
  WorkerSocket() = default;
  WorkerSocket(WorkerSocket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  WorkerSocket& operator=(WorkerSocket&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  WorkerSocket(const WorkerSocket&) = delete;
  WorkerSocket& operator=(const WorkerSocket&) = delete;
  ~WorkerSocket() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept;  // unregistered and closed at once

 private:
  friend WorkerSockets make_worker_sockets();
  int fd_ = -1;
};

struct WorkerSockets {
  WorkerSocket loader;  // the loader's end
  WorkerSocket worker;  // the worker's: close it here once the worker (or the fork server) has it
};

// A SOCK_SEQPACKET pair, both ends registered. Throws SystemError.
WorkerSockets make_worker_sockets();

// start_child(options) for a worker whose end is `worker_sock`: the child also closes every other
// registered socket and the fork server's socket (whose EOF is the server's exit), besides
// options.close_fds. Throws what start_child throws.
launch::detail::Child start_worker(launch::detail::ChildOptions options, int worker_sock);

}  // namespace forkguard::data::detail
