#include "launch/fork_server.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <variant>
#include <vector>

#include "detail/deadline.hpp"
#include "detail/registry.hpp"
#include "detail/seqpacket.hpp"

#include "forkguard/launch/exit_status.hpp"
#include "forkguard/launch/launcher.hpp"
#include "forkguard/probe/cuda_state.hpp"
#include "launch/child.hpp"
#include "launch/init_state.hpp"
#include "launch/zygote_loop.hpp"
#include "launch/zygote_protocol.hpp"

extern char** environ;

namespace forkguard::launch::detail {
namespace {

ForkServer* g_server = nullptr;
pid_t g_owner = 0;                // the process that started the zygote (its parent)
ForkServer* g_retired = nullptr;  // stopped: see stop()

using forkguard::detail::kMaxFds;
using forkguard::detail::recv_message;
using forkguard::detail::send_message;

forkguard::detail::Registry<ZygoteFunction>& zygote_functions() {
  static forkguard::detail::Registry<ZygoteFunction> functions("zygote function",
                                                               "register_zygote_function");
  return functions;
}

// ---------------------------------------------------------------- the zygote's side
// The requests of the zygote loop (launch/zygote_loop.hpp), which keeps every child as a Child
// until it exited and reports it.
//
// The zygote leaves by _exit() (EOF on its socket: the program is gone or stopping it), and the
// object is never destroyed (see fork_zygote): its children are stopped by their parent-death
// signal (a rank's reaper: SIGTERM, and it kills its tree; a call child: SIGKILL), all at once,
// not one by one by each Child's stop policy (SIGTERM, 5 s, SIGKILL), which would hold the
// zygote for up to 5 s per child while the program waits 1 s before it SIGKILLs the zygote.
class Zygote : public ZygoteHandler {
 public:
  explicit Zygote(int sock) : sock_(sock) {}
  Zygote(const Zygote&) = delete;
  Zygote& operator=(const Zygote&) = delete;

  [[noreturn]] void serve() {
    // The launcher decides what stops the ranks: the zygote blocks the stop signals (a terminal's
    // Ctrl-C reaches its process group too). Blocked, not ignored: a rank forked from here keeps
    // them pending until the child's set-up (launch/child.cpp) restores the defaults.
    sigset_t blocked;
    sigemptyset(&blocked);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&blocked, sig);
    ::sigprocmask(SIG_BLOCK, &blocked, nullptr);
    try {
      serve_zygote(sock_, *this, children_);
    } catch (const std::exception&) {  // its socket failed: the program is gone
    }
    ::_exit(0);  // PR_SET_PDEATHSIG takes our children with us (see the class comment)
  }

  std::variant<Child, std::vector<std::string>> handle(const std::vector<std::string>& f,
                                                       std::vector<int>& fds,
                                                       const std::vector<int>&) override {
    // Each child gets the attached fds it needs (start_child duplicates them); the loop closes
    // them here afterwards. Every other fd of the zygote is closed in the child.
    auto fd = [&](size_t i) { return i < fds.size() ? fds[i] : -1; };
    try {
      // A malformed request is refused before anything is forked: its reason is the reply.
      ZygoteRequest request = decode_zygote_request(f);
      ChildIo io{fd(0), fd(1)};
      if (auto* r = std::get_if<EntryRequest>(&request)) return start_entry(*r, io);
      if (auto* r = std::get_if<ExecRequest>(&request)) return start_exec(*r, io);
      return start_call(std::get<CallRequest>(request), io, fd(2));
    } catch (const std::exception& e) {
      return encode(ErrorReply{.message = e.what()});
    }
  }

 private:
  void check_clean() {
    auto dirty = probe::self_if_cuda_unsafe();  // its children run forkguard's C++ code only
    if (!dirty) return;
    const auto& state = *dirty;
    std::string evidence;
    for (const auto& e : state.evidence) {
      if (e.kind != probe::EvidenceKind::kEnvironment) evidence += "; " + e.detail;
    }
    throw Error(
        fmt::format("the fork server (PID {}) is itself not fork-safe ({}{}): something "
                    "initialized CUDA before forkguard::init() ran",
                    ::getpid(), probe::to_string(state.verdict), evidence));
  }

  Child start_entry(EntryRequest& r, const ChildIo& io) {
    EntryFunction fn = find_entry(r.name);
    if (fn == nullptr) throw Error(unknown_entry(r.name));
    check_clean();
    auto envp = c_array(r.env);
    const RankContext& ctx = r.ctx;
    return start_child({.main = [fn, &ctx] { return fn(ctx); },
                        .environ_for_main = envp.data(),
                        .stdout_fd = io.stdout_fd,
                        .stderr_fd = io.stderr_fd,
                        .reap_tree = true,
                        .what = fmt::format("rank {}", ctx.rank)});
  }

  Child start_exec(const ExecRequest& r, const ChildIo& io) {
    EnvMap env;
    for (const auto& kv : r.env) {
      auto eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    const auto exec = prepare_exec(r.argv, env);
    return start_child(
        {.exec = &exec, .stdout_fd = io.stdout_fd, .stderr_fd = io.stderr_fd, .reap_tree = true});
  }

  // The function's fd is the third attached fd.
  Child start_call(const CallRequest& r, const ChildIo& io, int fd) {
    if (fd < 0) throw Error("zygote request \"call\": no fd attached for the function");
    auto found = zygote_functions().find(r.function);
    if (!found) throw Error(zygote_functions().unknown(r.function));
    check_clean();
    ZygoteFunction fn = *found;
    // A fork of the single-threaded zygote: the function may allocate. Its fd is 3 there (the
    // zygote's own socket is not passed on).
    return start_child({.main = [fn] { return fn(3); },
                        .stdout_fd = io.stdout_fd,
                        .stderr_fd = io.stderr_fd,
                        .keep_fds = {{fd, 3, false}},
                        .what = r.function});
  }

  int sock_;
  std::map<pid_t, Child> children_;  // started, not yet reaped
};

}  // namespace

ForkServer* ForkServer::get() {
  return g_server;
}

namespace {

// Forks a zygote from this process; returns it and our end of its socket.
std::pair<Child, int> fork_zygote() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    throw SystemError("fork server: socketpair", errno);
  }
  forkguard::detail::UniqueFd mine(sv[0]), theirs(sv[1]);
  // The zygote. init() runs before the program creates threads, so this process is a
  // single-threaded copy and may allocate (a restart forks a program that may run threads: it
  // only needs malloc, which glibc makes safe in a forked child, and its own state). It keeps
  // stdio and its socket (at 3), stays in the program's process group, and is reaped by its
  // owner through its Child (ForkServer::stop, replace_dead_zygote). Not waitable: the program's
  // own reap-all loop (`while (wait(NULL) > 0)`, Python's os.wait() until ChildProcessError) ends
  // with it running. The Zygote is never destroyed (it leaves by _exit): its Child handles must
  // not stop its children one by one, not even when something unwinds through serve().
  Child zygote = start_child({.main = []() -> int { (new Zygote(3))->serve(); },
                              .keep_fds = {{theirs.get(), 3, true}},
                              .group = ProcessGroup::kInherit,
                              .name = "forkguard-zygote",
                              .waitable = false,
                              .what = "the fork server"});
  return {std::move(zygote), mine.release()};
}

}  // namespace

void ForkServer::start() {
  if (g_server != nullptr) return;
  const bool first = g_owner == 0;
  auto [zygote, sock] = fork_zygote();
  g_server = new ForkServer(zygote.pid(), sock);
  g_server->zygote_ = std::move(zygote);
  g_owner = ::getpid();
  // At exit, close the socket (the zygote sees EOF and exits) and reap it here, so it never
  // becomes a zombie for init to collect. Registered once (a start after stop() reuses it).
  if (first) std::atexit([] { stop(); });
}

void ForkServer::stop() {
  if (g_server == nullptr || ::getpid() != g_owner) return;  // a forked rank calling exit()
  Child& zygote = g_server->zygote_;
  g_server->sock_.reset();
  // EOF ends it at once, unless a child of ours that is not forkguard's (an os.fork() left
  // running) holds a copy of the socket: then it is killed (it holds no state; what it forked
  // dies with it) rather than waited for.
  if (!zygote.wait_for(std::chrono::seconds(1))) zygote.signal(SIGKILL);
  zygote.wait();
  // Never deleted: whoever still holds it finds a closed socket. Kept reachable (for LeakSanitizer
  // too) from a list of the stopped.
  g_server->retired_next_ = g_retired;
  g_retired = g_server;
  g_server = nullptr;
}

std::shared_ptr<ForkServer> ForkServer::attach(pid_t pid, int sock) {
  static std::mutex mutex;
  static std::map<pid_t, std::weak_ptr<ForkServer>> attached;
  std::lock_guard lock(mutex);
  std::erase_if(attached, [](const auto& a) { return a.second.expired(); });
  if (auto live = attached[pid].lock()) return live;
  int own = ::fcntl(sock, F_DUPFD_CLOEXEC, 3);
  if (own < 0) throw SystemError("fork server: dup of the attached socket", errno);
  std::shared_ptr<ForkServer> s(new ForkServer(pid, own));
  s->attached_ = true;
  attached[pid] = s;
  return s;
}

std::string ForkServer::replace_dead_zygote() {
  if (attached_) throw SpawnError(ended());
  // Its socket is closed: it has exited, or is about to. Reap it (SIGKILL in case it lingers).
  std::optional<ExitStatus> status = zygote_.try_wait();
  if (!status) {
    zygote_.signal(SIGKILL);
    status = zygote_.wait();
  }
  // Not started: not ours to reap (this is a fork of its owner), or nothing to wait for.
  const std::string how =
      status->kind != ExitStatus::Kind::kNotStarted ? status->to_string() : std::string("exited");
  const std::string dead = fmt::format("the fork server (PID {}) died ({})", pid_, how);
  if (::getpid() != g_owner) {
    throw SpawnError(dead + "; it belongs to the process that started it, not to this fork");
  }
  if (auto dirty = probe::self_if_cuda_unsafe()) {
    throw SpawnError(fmt::format(
        "{}, and no new one can be forked from this process: it holds CUDA state ({}); use "
        "thread workers or the spawn start method",
        dead, probe::to_string(dirty->verdict)));
  }
  auto [zygote, sock] = fork_zygote();
  const std::string notice = fmt::format("{}; started a new one (PID {})", dead, zygote.pid());
  pid_ = zygote.pid();
  zygote_ = std::move(zygote);  // the dead one is reaped: nothing to stop
  sock_ = forkguard::detail::UniqueFd(sock);
  exits_.clear();  // its children died with it (PR_SET_PDEATHSIG); nobody waits for their news
  have_reply_ = false;
  closed_ = false;
  ended_.clear();
  std::fprintf(stderr, "forkguard: %s\n", notice.c_str());
  return notice;
}

bool ForkServer::read_one(bool block) {
  std::vector<std::string> f;
  int fds[kMaxFds];
  if (!recv_message(sock_.get(), f, fds, block ? 0 : MSG_DONTWAIT)) {
    if (errno != EAGAIN && errno != EWOULDBLOCK) closed_ = true;
    return false;
  }
  UniqueFd first(fds[0]);  // kept with a reply (a child's pidfd); the others are not used
  for (int k = 1; k < kMaxFds; ++k) {
    if (fds[k] >= 0) ::close(fds[k]);
  }
  ZygoteReply reply;
  try {
    reply = decode_zygote_reply(f);
  } catch (const Error& e) {  // taken as the reply to the request in flight, which fails with it
    reply = ErrorReply{.message = fmt::format("a malformed reply ({})", e.what())};
  }
  if (const auto* exit = std::get_if<ExitReport>(&reply)) {
    exits_.emplace_back(exit->pid, exit->status);
  } else {
    reply_ = std::move(reply);
    reply_fields_ = std::move(f);
    reply_fd_ = std::move(first);
    have_reply_ = true;
  }
  return true;
}

std::optional<std::vector<std::string>> ForkServer::exchange(
    const std::vector<std::string>& fields, const std::vector<int>& fds,
    std::optional<std::chrono::milliseconds> timeout, UniqueFd* reply_fd) {
  const auto deadline =
      timeout ? std::optional(std::chrono::steady_clock::now() + *timeout) : std::nullopt;
  std::lock_guard lock(mutex_);  // the reply is this request's: no other request in between
  const auto closed = [&] { return SpawnError(ended()); };
  have_reply_ = false;
  if (!fields.empty() &&
      !send_message(sock_.get(), fields, fds.data(), static_cast<int>(fds.size()))) {
    if (errno == EPIPE || errno == ECONNRESET) throw closed();
    throw SystemError(fmt::format("fork server (PID {}): sending a request", pid_), errno);
  }
  while (!have_reply_) {
    pollfd p{sock_.get(), POLLIN, 0};
    const int r = ::poll(&p, 1, forkguard::detail::poll_ms(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw SystemError("poll on the fork server's socket", errno);
    if (r == 0) return std::nullopt;
    if (!read_one(false) && errno != EAGAIN) throw closed();
  }
  have_reply_ = false;
  if (reply_fd) *reply_fd = std::move(reply_fd_);
  reply_fd_.reset();
  return std::move(reply_fields_);
}

std::string ForkServer::ended() {
  if (!ended_.empty()) return ended_;
  std::string how = "its socket closed";
  // Its socket closes as it exits, a moment before it can be waited for: give it that moment.
  const UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)));
  if (pidfd) {
    pollfd q{pidfd.get(), POLLIN, 0};
    ::poll(&q, 1, 1000);
  }
  siginfo_t info{};
  if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOWAIT | WNOHANG | __WALL) == 0 &&
      info.si_pid == pid_) {
    const auto status = info.si_code == CLD_EXITED
                            ? ExitStatus::exited(info.si_status)
                            : ExitStatus::signaled(info.si_status, info.si_code == CLD_DUMPED);
    how = status.to_string();
  }
  ended_ = fmt::format("the fork server (PID {}) ended ({})", pid_, how);
  return ended_;
}

std::vector<std::pair<pid_t, int>> ForkServer::take_exits(const std::function<bool(pid_t)>& mine) {
  std::lock_guard lock(mutex_);
  while (read_one(false)) {
  }
  std::vector<std::pair<pid_t, int>> out;
  std::erase_if(exits_, [&](const std::pair<pid_t, int>& e) {
    if (!mine(e.first)) return false;
    out.push_back(e);
    return true;
  });
  return out;
}

std::optional<int> ForkServer::wait_exit(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock lock(mutex_);
  while (true) {
    while (read_one(false)) {
    }
    for (auto it = exits_.begin(); it != exits_.end(); ++it) {
      if (it->first == pid) {
        int status = it->second;
        exits_.erase(it);
        return status;
      }
    }
    if (closed_) {
      throw SpawnError(fmt::format("{}: no exit report of PID {} will come", ended(), pid));
    }
    auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    pollfd p{sock_.get(), POLLIN, 0};
    lock.unlock();  // another thread may be reading the same socket meanwhile
    ::poll(&p, 1, static_cast<int>(std::min<long>(left.count(), 50)));
    lock.lock();
  }
}

ServerChild ForkServer::request(const std::vector<std::string>& fields, int stdout_fd,
                                int stderr_fd, int extra_fd) {
  std::lock_guard lock(mutex_);
  int fds[kMaxFds] = {stdout_fd >= 0 ? stdout_fd : 1, stderr_fd >= 0 ? stderr_fd : 2, extra_fd};
  // A zygote found dead (killed, OOM) is reaped and replaced once per request: it failed every
  // later request with "Broken pipe" and stayed a zombie.
  for (int attempt = 0;; ++attempt) {
    bool alive = send_message(sock_.get(), fields, fds, extra_fd >= 0 ? 3 : 2);
    have_reply_ = false;
    while (alive && !have_reply_) alive = read_one(true);
    if (alive) break;
    if (attempt > 0) {
      throw SpawnError(ended());
    }
    replace_dead_zygote();
  }
  UniqueFd sent = std::move(reply_fd_);
  if (const auto* started = std::get_if<StartedReply>(&reply_)) {
    // Both fork servers send the child's pidfd with the reply (launch/zygote_loop.hpp): opened
    // before the child could be reaped, it names that child for good. Without it the child could
    // be signalled only by a PID that may be another process's by then: refused, for every
    // requester alike (the child sees EOF on what the requester gave it, or ends with the server).
    if (!sent) {
      throw SpawnError(
          fmt::format("the fork server (PID {}) started PID {} without its pidfd: it "
                      "could not be signalled safely",
                      pid_, started->pid));
    }
    return ServerChild(started->pid, std::move(sent));
  }
  throw SpawnError(fmt::format("the fork server (PID {}) refused: {}", pid_,
                               std::get<ErrorReply>(reply_).message));
}

ServerChild ForkServer::start_entry(const std::string& entry, const RankContext& ctx,
                                    const std::vector<std::string>& env, int stdout_fd,
                                    int stderr_fd, int extra_fd) {
  return request(encode(EntryRequest{.name = entry, .ctx = ctx, .env = env}), stdout_fd, stderr_fd,
                 extra_fd);
}

ServerChild ForkServer::start_exec(const std::vector<std::string>& argv,
                                   const std::vector<std::string>& env, int stdout_fd,
                                   int stderr_fd) {
  return request(encode(ExecRequest{.argv = argv, .env = env}), stdout_fd, stderr_fd);
}

ServerChild ForkServer::start_call(const std::string& function, int fd, int stdout_fd,
                                   int stderr_fd) {
  return request(encode(CallRequest{.function = function}), stdout_fd, stderr_fd, fd);
}

bool register_zygote_function(const char* name, ZygoteFunction fn, const char* file, int line) {
  return zygote_functions().add(name, fn, file, line);
}

ZygoteFunction find_zygote_function(std::string_view name) {
  return zygote_functions().find(name).value_or(nullptr);
}

std::string unknown_zygote_function(std::string_view name) {
  return zygote_functions().unknown(name);
}

}  // namespace forkguard::launch::detail
