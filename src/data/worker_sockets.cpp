#include "data/worker_sockets.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <set>

#include "forkguard/error.hpp"
#include "launch/fork_server.hpp"

namespace forkguard::data::detail {
namespace {

struct Registry {
  pid_t owner = ::getpid();
  std::mutex mutex;  // held from reading `open` to the fork, and around every change
  std::set<int> open;
};

std::atomic<Registry*> g_registry{nullptr};

// This process's registry: made at the first use, and made again in a forked copy of this process,
// which leaves the parent's copy as it is (never destroyed: its lock may be held).
Registry& registry() {
  const pid_t self = ::getpid();
  Registry* r = g_registry.load(std::memory_order_acquire);
  while (r == nullptr || r->owner != self) {
    auto* fresh = new Registry;
    if (g_registry.compare_exchange_strong(r, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread made one first: `r` is it now
  }
  return *r;
}

}  // namespace

void WorkerSocket::reset() noexcept {
  if (fd_ < 0) return;
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.open.erase(fd_);
  ::close(std::exchange(fd_, -1));
}

WorkerSockets make_worker_sockets() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    throw SystemError("socketpair for a worker", errno);
  }
  try {
    r.open.insert(sv[0]);
    r.open.insert(sv[1]);
  } catch (...) {
    r.open.erase(sv[0]);
    ::close(sv[0]);
    ::close(sv[1]);
    throw;
  }
  WorkerSockets pair;
  pair.loader.fd_ = sv[0];
  pair.worker.fd_ = sv[1];
  return pair;
}

launch::detail::Child start_worker(launch::detail::ChildOptions options, int worker_sock) {
  if (const auto* server = launch::detail::ForkServer::get()) {
    options.close_fds.push_back(server->fd());
  }
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  for (int fd : r.open) {
    if (fd != worker_sock) options.close_fds.push_back(fd);
  }
  std::sort(options.close_fds.begin(), options.close_fds.end());
  options.close_fds.erase(std::unique(options.close_fds.begin(), options.close_fds.end()),
                          options.close_fds.end());
  return launch::detail::start_child(options);
}

}  // namespace forkguard::data::detail
