#include "data/worker_processes.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "detail/deadline.hpp"
#include "forkguard/error.hpp"
#include "forkguard/launch/launcher.hpp"
#include "launch/fork_server.hpp"

namespace forkguard::data::detail {
namespace {

using launch::detail::ForkServer;

constexpr auto kExitGrace = std::chrono::seconds(2);
constexpr auto kKillWait = std::chrono::seconds(30);

void close_fds(const int (&fds)[kMaxFds], int from = 0) {
  for (int k = from; k < kMaxFds; ++k) {
    if (fds[k] >= 0) ::close(fds[k]);
  }
}

}  // namespace

void raise_data_error(const std::string& message) {
  throw DataError(message);
}

WorkerProcesses::WorkerProcesses(int workers, ForkServer* server)
    : server_(server), procs_(static_cast<size_t>(workers)) {}

WorkerProcesses::~WorkerProcesses() {
  stop(false);
}

void WorkerProcesses::started(int w, WorkerSocket sock) {
  auto& p = procs_[static_cast<size_t>(w)];
  p.sock = std::move(sock);
  p.alive = true;
}

void WorkerProcesses::start_call(int w, const std::string& function) {
  auto [mine, theirs] = make_worker_sockets();
  auto& p = procs_[static_cast<size_t>(w)];
  p.server_child = server_->start_call(function, theirs.get());
  p.pid = p.server_child.pid();
  theirs.reset();
  started(w, std::move(mine));  // from here, EOF once the pool stops: it exits, its server reaps it
}

int WorkerProcesses::send_setup(int w, size_t bytes, int fd) {
  if (send_message(socket(w), encode(SetupMessage{.bytes = bytes, .worker = w}), &fd, 1)) return 0;
  return errno;
}

void WorkerProcesses::start_fork(int w, launch::detail::ChildOptions options,
                                 std::function<int(int sock)> main,
                                 const std::function<void()>& before_fork,
                                 const std::function<void()>& after_fork_parent) {
  auto [mine, theirs] = make_worker_sockets();
  auto& p = procs_[static_cast<size_t>(w)];
  const int sock = theirs.get();
  options.main = [&main, sock] { return main(sock); };
  // The sockets of every worker pool of this process, ours included, are closed in the child by
  // start_worker, which reads them at the fork: before_fork may let other threads run (Python's
  // at-fork handlers), which start or stop loaders too.
  if (before_fork) before_fork();
  try {
    p.child = start_worker(std::move(options), sock);
  } catch (...) {
    if (after_fork_parent) after_fork_parent();
    throw;
  }
  if (after_fork_parent) after_fork_parent();
  p.pid = p.child.pid();
  theirs.reset();
  started(w, std::move(mine));
}

WorkerProcesses::FirstReply WorkerProcesses::first_reply(
    int w, std::optional<Clock::time_point> deadline) {
  auto& p = procs_[static_cast<size_t>(w)];
  if (!p.alive) return {.kind = FirstReply::Kind::kNotRunning};
  pollfd q{p.sock.get(), POLLIN, 0};
  int r;
  do {
    r = ::poll(&q, 1, forkguard::detail::poll_ms(deadline));
  } while (r < 0 && errno == EINTR);
  if (r == 0) return {.kind = FirstReply::Kind::kTimeout};
  FirstReply out;
  int fds[kMaxFds];
  if (!recv_message(p.sock.get(), out.fields, fds)) {
    p.alive = false;
    collect(w, kExitGrace);
    return {.kind = FirstReply::Kind::kClosed};
  }
  close_fds(fds);
  return out;
}

WorkerProcesses::Received WorkerProcesses::receive(std::optional<Clock::time_point> deadline,
                                                   size_t first) {
  while (true) {
    std::vector<pollfd> fds;
    std::vector<int> who;
    const size_t n = procs_.size();
    for (size_t k = 0; k < n; ++k) {
      const size_t w = (first + k) % n;
      if (procs_[w].alive) {
        fds.push_back({procs_[w].sock.get(), POLLIN, 0});
        who.push_back(static_cast<int>(w));
      }
    }
    if (fds.empty()) return {};
    int r = ::poll(fds.data(), fds.size(), forkguard::detail::poll_ms(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw SystemError("poll on the workers", errno);
    if (r == 0) return {.kind = Received::Kind::kTimeout};
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      Received out{.kind = Received::Kind::kMessage, .worker = who[k]};
      int got[kMaxFds];
      if (!recv_message(fds[k].fd, out.fields, got, MSG_DONTWAIT)) {
        if (errno == EAGAIN) continue;
        end(out.worker);
        return {.kind = Received::Kind::kEnded, .worker = out.worker};
      }
      out.fd = UniqueFd(got[0]);
      close_fds(got, 1);
      return out;
    }
  }
}

void WorkerProcesses::end(int w) {
  auto& p = procs_[static_cast<size_t>(w)];
  p.alive = false;
  p.sock.reset();
  if (!collect(w, kExitGrace)) {  // it closed its socket yet lives on: make sure it is gone
    signal(w, SIGKILL);
    collect(w, kKillWait);
  }
}

void WorkerProcesses::stop(bool now) {
  for (int w = 0; w < size(); ++w) {
    auto& p = procs_[static_cast<size_t>(w)];
    p.sock.reset();  // EOF: the worker finishes what it does and exits
    if (now && p.alive) signal(w, SIGKILL);
  }
  for (int w = 0; w < size(); ++w) {
    if (alive(w)) end(w);
  }
}

void WorkerProcesses::signal(int w, int sig) {
  auto& p = procs_[static_cast<size_t>(w)];
  if (p.child) {
    p.child.signal(sig);
  } else {
    p.server_child.signal(sig);
  }
}

bool WorkerProcesses::collect(int w, std::chrono::milliseconds timeout) {
  auto& p = procs_[static_cast<size_t>(w)];
  if (p.status || !p.lost.empty() || p.pid <= 0) return true;
  if (!p.child) {  // the fork server's child: it reaps it and reports its exit
    if (server_ == nullptr) return false;  // detached: its exit report is not ours to read
    try {
      if (auto status = server_->wait_exit(p.pid, timeout)) {
        p.status = launch::ExitStatus::from_wait_status(*status);
      }
    } catch (const forkguard::launch::SpawnError&) {
      p.lost = server_->ended();  // its children die with it (PR_SET_PDEATHSIG)
      return true;
    }
    return p.status.has_value();
  }
  p.status = p.child.wait_for(timeout);
  return p.status.has_value();
}

std::string WorkerProcesses::how(int w) const {
  const auto& p = procs_[static_cast<size_t>(w)];
  if (!p.lost.empty()) return "died with its fork server: " + p.lost;
  // Not started: it could not be reaped (not ours any more).
  if (!p.status || p.status->kind == launch::ExitStatus::Kind::kNotStarted) {
    return "stopped (exit status unknown)";
  }
  return p.status->to_string();
}

std::vector<pid_t> WorkerProcesses::alive_pids() const {
  std::vector<pid_t> out;
  for (const auto& p : procs_) {
    if (p.alive) out.push_back(p.pid);
  }
  return out;
}

std::vector<pid_t> WorkerProcesses::pids_without_status() const {
  std::vector<pid_t> out;
  for (const auto& p : procs_) {
    if (p.pid > 0 && !p.status) out.push_back(p.pid);
  }
  return out;
}

}  // namespace forkguard::data::detail
