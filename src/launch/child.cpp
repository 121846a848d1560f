#include "launch/child.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>

#include "forkguard/launch/launcher.hpp"

extern char** environ;

namespace forkguard::launch::detail {
namespace {

std::string resolve_executable(const std::string& name, const EnvMap& env) {
  if (name.find('/') != std::string::npos) return name;
  auto it = env.find("PATH");
  std::string path = it != env.end() ? it->second : "/usr/local/bin:/usr/bin:/bin";
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t colon = path.find(':', pos);
    std::string dir =
        path.substr(pos, colon == std::string::npos ? std::string::npos : colon - pos);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    if (colon == std::string::npos) break;
    pos = colon + 1;
  }
  return name;  // execve reports ENOENT, and the error names it
}

// What the shell (and env, timeout) exit with when a command cannot be run.
int shell_exit_code(int err) {
  return err == ENOENT || err == ENOTDIR ? 127 : 126;
}

void close_fds_except(int keep) noexcept {
  if (keep < 3) {
    ::syscall(SYS_close_range, 3u, ~0u, 0u);
    return;
  }
  if (keep > 3) ::syscall(SYS_close_range, 3u, static_cast<unsigned>(keep - 1), 0u);
  ::syscall(SYS_close_range, static_cast<unsigned>(keep + 1), ~0u, 0u);
}

}  // namespace

void check_executable(const std::string& name, const EnvMap& env) {
  const std::string path = resolve_executable(name, env);
  const bool searched = name.find('/') == std::string::npos;
  struct stat st {};
  int err = 0;
  if (name.empty()) {
    err = ENOENT;
  } else if (::stat(path.c_str(), &st) != 0) {
    err = errno;
  } else if (S_ISDIR(st.st_mode)) {
    err = EISDIR;
  } else if (!S_ISREG(st.st_mode) || ::access(path.c_str(), X_OK) != 0) {
    err = EACCES;
  }
  if (err == 0) return;
  if (searched && path == name) {
    throw SpawnError(fmt::format("failed to execute {}: command not found (searched PATH={})", name,
                                 env.count("PATH") ? env.at("PATH") : "unset"),
                     127);
  }
  throw SpawnError(fmt::format("failed to execute {}: {}", path, std::strerror(err)),
                   shell_exit_code(err));
}

std::vector<std::string> flatten(const EnvMap& env) {
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

std::vector<char*> c_array(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

PreparedExec prepare_exec(const std::vector<std::string>& argv, const EnvMap& env) {
  if (argv.empty()) throw Error("error preparing to execute: empty command");
  PreparedExec p;
  p.path = resolve_executable(argv[0], env);
  p.argv_storage = argv;
  p.env_storage = flatten(env);
  p.argv = c_array(p.argv_storage);
  p.envp = c_array(p.env_storage);
  return p;
}

// ============ child side: no malloc, no locks, no exceptions from here ============
bool child_setup(pid_t parent, const ChildIo& io, int keep_fd) noexcept {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) return false;  // the parent died before PDEATHSIG was armed
  if (io.stdout_fd >= 0 && io.stdout_fd != 1) ::dup2(io.stdout_fd, 1);
  if (io.stderr_fd >= 0 && io.stderr_fd != 2) ::dup2(io.stderr_fd, 2);
  close_fds_except(keep_fd);
  // Dispositions first, then the mask: a stop signal that arrived while blocked is delivered
  // with its default action, never lost.
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGCHLD}) ::signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  return true;
}
// ===================================================================================

UniqueFd open_pidfd(pid_t pid) {
  UniqueFd fd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!fd) throw SystemError(fmt::format("pidfd_open({})", pid), errno);
  return fd;
}

StartedChild begin_exec(const PreparedExec& exec, const ChildIo& io) {
  int err_pipe[2];
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    throw SpawnError(
        fmt::format("error preparing to execute {}: pipe2: {}", exec.path, std::strerror(errno)));
  }
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    int e = errno;
    ::close(err_pipe[0]);
    ::close(err_pipe[1]);
    throw SpawnError(
        fmt::format("error preparing to execute {}: fork: {}", exec.path, std::strerror(e)));
  }
  if (pid == 0) {
    // ============ child: async-signal-safe only ============
    ::close(err_pipe[0]);
    if (child_setup(parent, io, err_pipe[1])) {
      ::execve(exec.path.c_str(), exec.argv.data(), exec.envp.data());
    }
    int e = errno;
    forkguard::detail::write_all(err_pipe[1], &e, sizeof e);
    ::_exit(127);
  }
  ::close(err_pipe[1]);
  StartedChild child;
  child.pid = pid;
  child.exec_check.reset(err_pipe[0]);
  child.pidfd = open_pidfd(pid);
  return child;
}

void await_exec(StartedChild& child, const std::string& path) {
  int child_errno = 0;
  ssize_t n;
  do {
    n = ::read(child.exec_check.get(), &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  child.exec_check.reset();
  if (n == sizeof child_errno) {
    ::waitpid(child.pid, nullptr, 0);
    throw SpawnError(fmt::format("failed to execute {}: {}", path, std::strerror(child_errno)),
                     shell_exit_code(child_errno));
  }
}

StartedChild spawn_exec(const PreparedExec& exec, const ChildIo& io) {
  auto child = begin_exec(exec, io);
  await_exec(child, exec.path);
  return child;
}

StartedChild fork_call(EntryFunction fn, const RankContext& ctx, char** envp, const ChildIo& io) {
  const pid_t parent = ::getpid();
  std::fflush(nullptr);  // nothing buffered is written twice
  pid_t pid = ::fork();
  if (pid < 0)
    throw SpawnError(fmt::format("fork for rank {}: {}", ctx.rank, std::strerror(errno)));
  if (pid == 0) {
    // ============ child: async-signal-safe until the entry function ============
    if (!child_setup(parent, io, -1)) ::_exit(1);
    environ = envp;
    int rc = 1;
    try {
      rc = fn(ctx);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: uncaught exception: %s\n", ctx.rank, e.what());
    } catch (...) {
      std::fprintf(stderr, "rank %d: uncaught exception of unknown type\n", ctx.rank);
    }
    std::fflush(nullptr);
    ::_exit(rc & 0xff);
  }
  StartedChild child;
  child.pid = pid;
  child.pidfd = open_pidfd(pid);
  return child;
}

}  // namespace forkguard::launch::detail

namespace forkguard::launch::detail {
namespace {

struct GuardMessage {
  std::int32_t op;
  std::int32_t pgid;
};
static_assert(sizeof(GuardMessage) <= PIPE_BUF, "one write, one message");
constexpr std::int32_t kGuardWatch = 1, kGuardForget = 2, kGuardDone = 3;
constexpr size_t kGuardMaxGroups = 8192;

// ============ child side (the watchdog): no malloc, no locks, no exceptions ============
[[noreturn]] void tree_guard_main(int from_owner) noexcept {
  // It must outlive the owner: no parent-death signal, deaf to what the terminal or the owner's
  // stop sends its process group, and holding none of the owner's files (a pipe a test or a
  // shell waits on for EOF, above all).
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGTSTP, SIGTTIN, SIGTTOU}) {
    ::signal(sig, SIG_IGN);
  }
  sigset_t none;
  ::sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  int null = ::open("/dev/null", O_RDWR);
  for (int fd = 0; fd < 3; ++fd) {
    if (null >= 0 && fd != from_owner) ::dup2(null, fd);
  }
  close_fds_except(from_owner);
  ::prctl(PR_SET_NAME, "fg-tree-guard");  // what ps and the tests see
  static pid_t groups[kGuardMaxGroups];   // static: not on a small stack, and no allocation
  size_t n = 0;
  for (;;) {
    GuardMessage m{};
    ssize_t got = ::read(from_owner, &m, sizeof m);
    if (got < 0 && errno == EINTR) continue;
    if (got != static_cast<ssize_t>(sizeof m)) break;  // EOF: the owner died without goodbye
    if (m.op == kGuardDone) ::_exit(0);
    if (m.op == kGuardWatch && n < kGuardMaxGroups && m.pgid > 1) groups[n++] = m.pgid;
    if (m.op == kGuardForget) {
      for (size_t i = 0; i < n; ++i) {
        if (groups[i] == m.pgid) groups[i--] = groups[--n];
      }
    }
  }
  for (size_t i = 0; i < n; ++i) ::kill(-groups[i], SIGKILL);
  ::_exit(0);
}
// ========================================================================================

}  // namespace

TreeGuard::TreeGuard() {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    throw SpawnError(
        fmt::format("error preparing the launch's watchdog: pipe2: {}", std::strerror(errno)));
  }
  UniqueFd read_end(p[0]);
  to_guard_.reset(p[1]);
  pid_ = ::fork();
  if (pid_ < 0) {
    throw SpawnError(
        fmt::format("error starting the launch's watchdog: fork: {}", std::strerror(errno)));
  }
  if (pid_ == 0) tree_guard_main(read_end.get());
}

TreeGuard::~TreeGuard() {
  send(kGuardDone, 0);
  to_guard_.reset();
  if (pid_ > 0) {
    while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

void TreeGuard::send(int op, pid_t pgid) noexcept {
  GuardMessage m{op, static_cast<std::int32_t>(pgid)};
  ssize_t n;
  do {
    n = ::write(to_guard_.get(), &m, sizeof m);
  } while (n < 0 && errno == EINTR);
}

void TreeGuard::watch(pid_t pgid) noexcept {
  send(kGuardWatch, pgid);
}
void TreeGuard::forget(pid_t pgid) noexcept {
  send(kGuardForget, pgid);
}

}  // namespace forkguard::launch::detail
