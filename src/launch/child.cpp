#include "launch/child.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>
#include <poll.h>
#include <sys/resource.h>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <set>

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

// ---------------------------------------------------------------- the fd plan

std::vector<FdStep> plan_fds(std::vector<FdMapping> mappings, bool close_others) {
  int next_free = 3;
  std::set<int> targets;
  for (const auto& m : mappings) {
    if (m.from < 0 || m.to < 0) {
      throw Error(fmt::format("fd plan: negative fd in the mapping {} -> {}", m.from, m.to));
    }
    if (!targets.insert(m.to).second) {
      throw Error(fmt::format("fd plan: two fds mapped to {}", m.to));
    }
    next_free = std::max({next_free, m.from + 1, m.to + 1});
  }
  std::vector<FdStep> steps;
  // A mapping may run once no other pending mapping still reads its target. When every pending
  // one waits on another (a cycle), one source is moved aside, above every fd named.
  while (!mappings.empty()) {
    auto ready = std::find_if(mappings.begin(), mappings.end(), [&](const FdMapping& m) {
      return std::none_of(mappings.begin(), mappings.end(),
                          [&](const FdMapping& o) { return &o != &m && o.from == m.to; });
    });
    if (ready == mappings.end()) {
      const int from = mappings.front().from, temp = next_free++;
      steps.push_back({FdStep::Op::kDup, from, temp, true});
      for (auto& m : mappings) {
        if (m.from == from) m.from = temp;
      }
      continue;
    }
    if (ready->from == ready->to) {
      steps.push_back({FdStep::Op::kSetFlags, ready->to, -1, ready->cloexec});
    } else {
      steps.push_back({FdStep::Op::kDup, ready->from, ready->to, ready->cloexec});
    }
    mappings.erase(ready);
  }
  if (close_others) {
    int first = 3;
    for (int t : targets) {
      if (t < first) continue;
      if (t > first) steps.push_back({FdStep::Op::kCloseRange, first, t - 1, false});
      first = t + 1;
    }
    steps.push_back({FdStep::Op::kCloseRange, first, -1, false});
  }
  return steps;
}

namespace {

// What the child reports through its close-on-exec pipe: a step that failed (and the errno),
// and, from a reaper, that the program started and whether it dumped core.
struct Report {
  std::int32_t kind;
  std::int32_t step;
  std::int32_t value;
};
static_assert(sizeof(Report) <= PIPE_BUF, "one write, one report");
constexpr std::int32_t kFailed = 1, kStarted = 2, kCore = 3;

enum Step : std::int32_t {
  kStepParentDeath = 1,
  kStepProcessGroup,
  kStepFds,
  kStepSignals,
  kStepExec,
  kStepReaper,
};

const char* step_name(int step) {
  switch (step) {
    case kStepParentDeath: return "setting the parent-death signal";
    case kStepProcessGroup: return "creating its process group";
    case kStepFds: return "arranging its file descriptors";
    case kStepSignals: return "resetting its signals";
    case kStepExec: return "execve";
    case kStepReaper: return "starting it under its reaper";
  }
  return "setting it up";
}

ExitStatus from_siginfo(const siginfo_t& info) {
  switch (info.si_code) {
    case CLD_EXITED: return ExitStatus::exited(info.si_status);
    case CLD_KILLED: return ExitStatus::signaled(info.si_status, false);
    case CLD_DUMPED: return ExitStatus::signaled(info.si_status, true);
    default: return {};
  }
}

// Everything the child needs, resolved before fork.
struct ChildPlan {
  const ChildOptions* options;
  const FdStep* steps;
  size_t nsteps;
  int report_fd;        // its number once the plan ran
  int early_report_fd;  // and before
  pid_t parent;
  pid_t parent_group;
  bool by_main_thread;  // forked by the parent's main thread (see the parent-death signal)
};

// The one fork() call site of forkguard (the trace library's interposers aside). Not waitable: a
// raw clone with no exit signal (fork's copy of the memory, none of glibc's fork handlers), which
// only a wait naming it with __WALL reaps.
pid_t fork_process(bool waitable) noexcept {
  if (waitable) return ::fork();
  return static_cast<pid_t>(::syscall(SYS_clone, 0UL, nullptr, nullptr, nullptr, 0UL));
}

// One thread in this process: a raw clone's copy may then allocate (no other thread held a lock).
bool single_threaded() {
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return false;
  int n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n == 1;
}

// ============ child side: no allocation, no locks, no exceptions from here ============
// Everything below runs between fork() and exec() (or the child's main function) in a copy of a
// process that may have had threads: system calls and the plan made before fork only.

void report(int fd, std::int32_t kind, std::int32_t step, std::int32_t value) noexcept {
  Report r{kind, step, value};
  forkguard::detail::write_all(fd, &r, sizeof r);
}

[[noreturn]] void fail(int fd, std::int32_t step, int err) noexcept {
  report(fd, kFailed, step, err);
  ::_exit(step == kStepExec ? (err == ENOENT || err == ENOTDIR ? 127 : 126) : 127);
}

bool apply_fds(const FdStep* steps, size_t n) noexcept {
  for (size_t i = 0; i < n; ++i) {
    const FdStep& s = steps[i];
    switch (s.op) {
      case FdStep::Op::kDup:
        if (::dup3(s.a, s.b, s.cloexec ? O_CLOEXEC : 0) < 0) return false;
        break;
      case FdStep::Op::kSetFlags:
        if (::fcntl(s.a, F_SETFD, s.cloexec ? FD_CLOEXEC : 0) < 0) return false;
        break;
      case FdStep::Op::kCloseRange: {
        const unsigned last = s.b < 0 ? ~0u : static_cast<unsigned>(s.b);
        if (::syscall(SYS_close_range, static_cast<unsigned>(s.a), last, 0u) != 0) {
          for (int fd = s.a; fd <= (s.b < 0 ? 65535 : s.b); ++fd) ::close(fd);  // no close_range
        }
        break;
      }
    }
  }
  return true;
}

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGCHLD};

// Dispositions back to their defaults (a stop signal that arrived while blocked is then
// delivered with its default action, never lost), then the mask.
void reset_signals(const sigset_t* mask) noexcept {
  for (int sig : kStopSignals) ::signal(sig, SIG_DFL);
  sigset_t none;
  ::sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, mask != nullptr ? mask : &none, nullptr);
}

// Every signal this process catches back to its default disposition (ignored ones stay ignored,
// as across exec).
void reset_handlers() noexcept {
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction sa {};
    if (::sigaction(sig, nullptr, &sa) != 0) continue;  // SIGKILL, SIGSTOP, glibc's own
    if (sa.sa_handler == SIG_DFL || sa.sa_handler == SIG_IGN) continue;
    ::signal(sig, SIG_DFL);
  }
}

// The program itself: exec, or the main function with its result as the exit code.
[[noreturn]] void run_program(const ChildOptions& o, int report_fd) noexcept {
  if (o.exec != nullptr) {
    ::execve(o.exec->path.c_str(), o.exec->argv.data(), o.exec->envp.data());
    fail(report_fd, kStepExec, errno);
  }
  ::close(report_fd);  // EOF: started
  // ---- the child's main function may allocate: it runs in a single-threaded copy (the fork
  // server, a CUDA-clean guarded fork), as the caller promised.
  if (o.environ_for_main != nullptr) environ = o.environ_for_main;
  int rc = 1;
  try {
    rc = o.main();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: uncaught exception: %s\n", o.what.c_str(), e.what());
  } catch (...) {
    std::fprintf(stderr, "%s: uncaught exception of unknown type\n", o.what.c_str());
  }
  std::fflush(nullptr);
  ::_exit(rc & 0xff);
}

// Decimal text of v at p; returns the end. For /proc paths without snprintf.
char* put_decimal(char* p, long v) noexcept {
  char tmp[24];
  int n = 0;
  do {
    tmp[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v > 0);
  while (n > 0) *p++ = tmp[--n];
  *p = '\0';
  return p;
}

char* put_text(char* p, const char* s) noexcept {
  while (*s != '\0') *p++ = *s++;
  *p = '\0';
  return p;
}

constexpr size_t kMaxTree = 16384;
pid_t g_tree[kMaxTree];  // static: no allocation, and not on the stack
char g_read[65536];
char g_dirents[16384];

// Appends the children of every thread of `pid` (/proc/PID/task/*/children) to g_tree.
void append_children(pid_t pid, size_t& n) noexcept {
  char path[96];
  char* e = put_decimal(put_text(path, "/proc/"), pid);
  put_text(e, "/task");
  int dir = ::open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return;
  for (;;) {
    long got = ::syscall(SYS_getdents64, dir, g_dirents, sizeof g_dirents);
    if (got <= 0) break;
    for (long off = 0; off < got;) {
      auto* d = reinterpret_cast<struct dirent64*>(g_dirents + off);
      off += d->d_reclen;
      if (d->d_name[0] < '0' || d->d_name[0] > '9') continue;
      char file[160];
      put_text(put_text(put_text(put_text(file, path), "/"), d->d_name), "/children");
      int fd = ::open(file, O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      ssize_t len = ::read(fd, g_read, sizeof g_read - 1);
      ::close(fd);
      long v = -1;
      for (ssize_t i = 0; i < std::max<ssize_t>(len, 0) + 1; ++i) {
        const char c = i < len ? g_read[i] : ' ';
        if (c >= '0' && c <= '9') {
          v = (v < 0 ? 0 : v * 10) + (c - '0');
        } else if (v > 0) {
          if (n < kMaxTree) g_tree[n++] = static_cast<pid_t>(v);
          v = -1;
        }
      }
    }
  }
  ::close(dir);
}

// SIGKILLs every descendant of this process, setsid()'d ones included: each is stopped before
// its own children are listed, so none forks past the walk. Returns how many it found.
size_t kill_descendants() noexcept {
  size_t n = 0;
  append_children(::getpid(), n);
  for (size_t i = 0; i < n; ++i) {
    ::kill(g_tree[i], SIGSTOP);
    append_children(g_tree[i], n);
  }
  for (size_t i = 0; i < n; ++i) ::kill(g_tree[i], SIGKILL);
  return n;
}

// The wait status of `program`, once every descendant is dead and reaped.
int kill_and_reap_all(pid_t program, int status, bool have_status) noexcept {
  for (;;) {
    kill_descendants();
    int st = 0;
    pid_t w = ::waitpid(-1, &st, 0);
    if (w < 0) {
      if (errno == EINTR) continue;
      break;  // ECHILD: nothing is left
    }
    if (w == program && !have_status) {
      status = st;
      have_status = true;
    }
  }
  return have_status ? status : (SIGKILL & 0x7f);
}

// The reaper: a subreaper between the parent and the program. It starts the program, says when it
// started, passes on the signals its parent sends it, and when the program exits or the parent
// dies, kills what is left of the tree, reaps it, and exits as the program did.
[[noreturn]] void reaper_main(const ChildPlan& p) noexcept {
  const ChildOptions& o = *p.options;
  const int out = p.report_fd;
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  int inner[2];
  if (::pipe2(inner, O_CLOEXEC) != 0) fail(out, kStepReaper, errno);
  const pid_t self = ::getpid();
  pid_t program;
  if (o.exec != nullptr) {
    // A program to execute: vfork, as posix_spawn does (posix_spawn cannot set the parent-death
    // signal), not a copy of this process's page tables that exec throws away at once: 0.1 ms
    // less on each rank's start (docs/performance.md). The child borrows this memory until its
    // exec or _exit: it only makes system calls, writes nothing of ours, returns from nothing,
    // and never enters the dynamic linker (libforkguard and the CLI are linked -z now). No
    // handler of the launcher's may run on borrowed memory in the moment between unblocking and
    // exec: every caught signal goes back to its default first (as the exec does anyway).
    reset_handlers();
    program = ::vfork();
  } else {
    program = fork_process(true);
  }
  if (program < 0) fail(out, kStepReaper, errno);
  if (program == 0) {
    ::close(inner[0]);
    ::close(out);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != self) ::_exit(1);
    if (o.name != nullptr) ::prctl(PR_SET_NAME, o.name);
    reset_signals(o.signal_mask);
    run_program(o, inner[1]);
  }
  ::close(inner[1]);
  // Out of the program's group, back in the parent's: a stop sent to the group reaches the
  // program and what it started there, and this process stays to clean up after them.
  if (o.group == ProcessGroup::kNew) ::setpgid(0, p.parent_group);
  ::prctl(PR_SET_NAME, "fg-reaper");
  Report r{};
  ssize_t got;
  do {
    got = ::read(inner[0], &r, sizeof r);
  } while (got < 0 && errno == EINTR);
  ::close(inner[0]);
  if (got == static_cast<ssize_t>(sizeof r) && r.kind == kFailed) {
    kill_and_reap_all(program, 0, false);
    fail(out, r.step, r.value);
  }
  report(out, kStarted, 0, program);

  sigset_t all;
  ::sigprocmask(SIG_SETMASK, nullptr, &all);  // what reaper_setup blocked
  int status = 0;
  for (;;) {
    siginfo_t si{};
    const int sig = ::sigwaitinfo(&all, &si);
    if (sig < 0) continue;
    if (::getppid() != p.parent) {
      status = kill_and_reap_all(program, 0, false);  // the parent is gone: so is the tree
      break;
    }
    if (sig == SIGCHLD) {
      int st = 0;
      bool done = false;
      pid_t w;
      while ((w = ::waitpid(-1, &st, WNOHANG)) > 0) {
        if (w == program) {
          status = st;
          done = true;
        }
      }
      if (done) {
        // No child left (ECHILD) is no descendant left: a dead process's children are this
        // subreaper's before it is reaped. Otherwise the walk of /proc finds them.
        if (!(w < 0 && errno == ECHILD)) status = kill_and_reap_all(program, status, true);
        break;
      }
      continue;
    }
    // From the parent, for the program (a terminal's signals reach the program by its group).
    if (si.si_pid == p.parent && (si.si_code == SI_USER || si.si_code == SI_QUEUE)) {
      ::kill(program, si.si_code == SI_QUEUE ? si.si_value.sival_int : sig);
    }
  }
  if (WIFEXITED(status)) ::_exit(WEXITSTATUS(status));
  const int sig = WTERMSIG(status);
  if (WCOREDUMP(status)) report(out, kCore, 0, 1);
  const rlimit no_core{0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);  // the program's core is the one that counts
  ::signal(sig, SIG_DFL);
  sigset_t just;
  ::sigemptyset(&just);
  ::sigaddset(&just, sig);
  ::sigprocmask(SIG_UNBLOCK, &just, nullptr);
  ::kill(::getpid(), sig);
  ::_exit(128 + sig);
}

[[noreturn]] void child_main(const ChildPlan& p) noexcept {
  const ChildOptions& o = *p.options;
  const int early_fd = p.early_report_fd;  // the plan moves it
  if (o.reap_tree) {
    // Stop signals wait for the reaper's loop (blocked before the parent-death signal is armed,
    // so that one is not lost); faults keep their default action.
    sigset_t all;
    ::sigfillset(&all);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS}) {
      ::sigdelset(&all, sig);
    }
    ::sigprocmask(SIG_SETMASK, &all, nullptr);
  }
  // The kernel sends the parent-death signal when the thread that forked ends, not the process.
  // A reaper gets it whichever thread forked it (without it a SIGKILLed parent would leave a
  // whole tree). Another child gets it only from a fork by the parent's main thread, whose end
  // is the process's: forked by another thread (a DataLoader iterated in a thread, its
  // persistent workers used after that thread ended) it would die with that thread; it learns of
  // its parent's death from its own channels instead (EOF on its socket), as torch's workers do.
  const int death_signal = o.reap_tree ? SIGTERM : (p.by_main_thread ? o.parent_death_signal : 0);
  if (death_signal != 0) {
    if (::prctl(PR_SET_PDEATHSIG, death_signal) != 0) fail(early_fd, kStepParentDeath, errno);
    if (::getppid() != p.parent) ::_exit(1);  // it died before the signal was armed
  }
  if (o.group == ProcessGroup::kNew && ::setpgid(0, 0) != 0) {
    fail(early_fd, kStepProcessGroup, errno);
  }
  for (int fd : o.close_fds) ::close(fd);
  if (!apply_fds(p.steps, p.nsteps)) fail(early_fd, kStepFds, errno);
  if (o.reap_tree) {
    for (int sig : kStopSignals) ::signal(sig, SIG_DFL);
    reaper_main(p);
  }
  if (o.name != nullptr) ::prctl(PR_SET_NAME, o.name);
  reset_signals(o.signal_mask);
  run_program(o, p.report_fd);
}
// ================================= end of the child side =================================

}  // namespace

UniqueFd open_pidfd(pid_t pid) {
  UniqueFd fd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!fd) throw SystemError(fmt::format("pidfd_open({})", pid), errno);
  return fd;
}

namespace {

// The process a pidfd refers to, from /proc/self/fdinfo: its PID, -1 once it was reaped, nullopt
// when `fd` is no pidfd.
std::optional<pid_t> pidfd_target(int fd) {
  const std::string path = fmt::format("/proc/self/fdinfo/{}", fd);
  UniqueFd info(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!info) return std::nullopt;
  char buf[4096];
  std::string text;
  for (ssize_t n; (n = ::read(info.get(), buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::nullopt;
    text.append(buf, static_cast<size_t>(n));
  }
  const auto at = text.find("\nPid:\t");
  if (at == std::string::npos) return std::nullopt;
  return static_cast<pid_t>(std::strtol(text.c_str() + at + 6, nullptr, 10));
}

}  // namespace

ServerChild::ServerChild(pid_t pid, UniqueFd pidfd) : pid_(pid), pidfd_(std::move(pidfd)) {
  const auto target = pidfd_ ? pidfd_target(pidfd_.get()) : std::nullopt;
  if (!target) throw Error(fmt::format("the handle of PID {} is no pidfd", pid));
  if (*target != pid && *target != -1) {  // -1: it has exited and its parent reaped it already
    throw Error(fmt::format("the handle of PID {} is the pidfd of PID {}", pid, *target));
  }
}

bool ServerChild::signal(int sig) const noexcept {
  if (!pidfd_ || exited()) return false;
  return ::syscall(SYS_pidfd_send_signal, pidfd_.get(), sig, nullptr, 0) == 0;
}

void ServerChild::signal_group(int sig) const noexcept {
  if (pid_ > 0 && ::kill(-pid_, sig) == 0) return;
  signal(sig);
}

bool ServerChild::exited() const noexcept {
  if (!pidfd_) return true;
  pollfd p{pidfd_.get(), POLLIN, 0};
  int r;
  do {
    r = ::poll(&p, 1, 0);
  } while (r < 0 && errno == EINTR);
  return r > 0;
}

Child start_child(const ChildOptions& o) {
  if ((o.exec == nullptr) == !o.main) {
    throw Error("start_child: give exactly one of exec and main");
  }
  const std::string what = !o.what.empty() ? o.what : o.exec != nullptr ? o.exec->path : "a child";
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    throw SpawnError(
        fmt::format("error preparing to execute {}: pipe2: {}", what, std::strerror(errno)));
  }
  UniqueFd report_r(pipe_fds[0]), report_w(pipe_fds[1]);
  std::vector<FdMapping> mappings;
  int top = 2;
  for (auto [fd, to] : {std::pair{o.stdin_fd, 0}, {o.stdout_fd, 1}, {o.stderr_fd, 2}}) {
    if (fd >= 0) mappings.push_back({fd, to, false});
  }
  for (const auto& k : o.keep_fds) {
    mappings.push_back(k);
    top = std::max(top, k.to);
  }
  // The report pipe stays where it is unless that number is taken, or the rest is closed.
  bool taken = std::any_of(mappings.begin(), mappings.end(),
                           [&](const FdMapping& m) { return m.to == report_w.get(); });
  const int report_at = o.close_other_fds || taken ? top + 1 : report_w.get();
  mappings.push_back({report_w.get(), report_at, true});
  const std::vector<FdStep> steps = plan_fds(std::move(mappings), o.close_other_fds);
  const ChildPlan plan{&o,
                       steps.data(),
                       steps.size(),
                       report_at,
                       report_w.get(),
                       ::getpid(),
                       ::getpgrp(),
                       ::gettid() == ::getpid()};
  if (o.main) std::fflush(nullptr);  // nothing buffered is written twice (an exec drops it)
  const bool waitable = o.waitable || o.exec != nullptr || !single_threaded();
  const pid_t pid = fork_process(waitable);
  if (pid < 0) {
    throw SpawnError(
        fmt::format("error preparing to execute {}: fork: {}", what, std::strerror(errno)));
  }
  if (pid == 0) child_main(plan);
  report_w.reset();
  Child c;
  c.pid_ = pid;
  c.owner_ = ::getpid();
  c.report_ = std::move(report_r);
  c.own_group_ = o.group == ProcessGroup::kNew;
  c.reaper_ = o.reap_tree;
  c.waitable_ = waitable;
  c.stop_ = o.stop;
  c.what_ = what;
  c.start_pending_ = true;
  // Also from here, so that a signal to its group cannot miss it (not for a reaper: it leaves
  // that group again once the program runs).
  if (c.own_group_ && !c.reaper_) ::setpgid(pid, pid);
  c.pidfd_.reset(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!c.pidfd_) {
    const int e = errno;
    ::kill(pid, SIGKILL);
    c.wait();
    throw SystemError(fmt::format("pidfd_open({}) for {}", pid, what), e);
  }
  if (o.await_start) c.await_start();
  return c;
}

Child::Child(Child&& o) noexcept {
  *this = std::move(o);
}

Child& Child::operator=(Child&& o) noexcept {
  if (this != &o) {
    if (running() && ::getpid() == owner_) stop();
    pid_ = std::exchange(o.pid_, -1);
    owner_ = o.owner_;
    pidfd_ = std::move(o.pidfd_);
    report_ = std::move(o.report_);
    reaped_ = std::exchange(o.reaped_, false);
    own_group_ = o.own_group_;
    reaper_ = o.reaper_;
    start_pending_ = std::exchange(o.start_pending_, false);
    waitable_ = o.waitable_;
    stop_ = o.stop_;
    what_ = std::move(o.what_);
    status_ = o.status_;
  }
  return *this;
}

// A fork's copy of a handle (the process that started the child forked since) is not the child's
// parent: it leaves the child alone, as it could neither reap it nor stop it by its policy.
Child::~Child() {
  if (running() && ::getpid() == owner_) stop();
}

void Child::await_start() {
  if (!start_pending_) return;
  start_pending_ = false;
  Report r{};
  ssize_t n;
  do {
    n = ::read(report_.get(), &r, sizeof r);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(sizeof r) && r.kind == kFailed) {
    report_.reset();
    wait();
    if (r.step == kStepExec) {
      throw SpawnError(fmt::format("failed to execute {}: {}", what_, std::strerror(r.value)),
                       r.value == ENOENT || r.value == ENOTDIR ? 127 : 126);
    }
    throw SpawnError(fmt::format("error preparing to execute {}: {}: {}", what_, step_name(r.step),
                                 std::strerror(r.value)));
  }
  if (!reaper_) report_.reset();  // EOF: exec'd, or its main function runs
}

void Child::signal(int sig) noexcept {
  if (!running()) return;
  if (own_group_ && ::kill(-pid_, sig) == 0) return;
  if (own_group_ && reaper_) return;  // the program's group is gone; the reaper ends by itself
  if (reaper_) {
    // The reaper passes on what its parent sends it; SIGKILL travels as the value of a SIGTERM.
    sigval v{};
    v.sival_int = sig;
    ::sigqueue(pid_, sig == SIGKILL || sig == SIGSTOP ? SIGTERM : sig, v);
    return;
  }
  ::syscall(SYS_pidfd_send_signal, pidfd_.get(), sig, nullptr, 0);
}

ExitStatus Child::reaped(ExitStatus s) {
  if (reaper_ && report_ && s.kind == ExitStatus::Kind::kSignaled) {
    ::fcntl(report_.get(), F_SETFL, O_NONBLOCK);
    Report r{};
    if (::read(report_.get(), &r, sizeof r) == static_cast<ssize_t>(sizeof r) && r.kind == kCore) {
      s.core_dumped = true;
    }
  }
  report_.reset();
  pidfd_.reset();
  reaped_ = true;
  status_ = s;
  return s;
}

std::optional<ExitStatus> Child::try_wait() {
  if (pid_ <= 0 || reaped_) return status_;
  siginfo_t info{};
  if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | __WALL) != 0) {
    if (errno == EINTR) return std::nullopt;
    return reaped(ExitStatus{});  // not ours to reap any more
  }
  if (info.si_pid == 0) return std::nullopt;
  return reaped(from_siginfo(info));
}

ExitStatus Child::wait() {
  if (pid_ <= 0 || reaped_) return status_;
  siginfo_t info{};
  while (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | __WALL) != 0) {
    if (errno != EINTR) return reaped(ExitStatus{});
  }
  return reaped(from_siginfo(info));
}

std::optional<ExitStatus> Child::wait_for(std::chrono::milliseconds timeout) {
  if (!running()) return try_wait();
  pollfd p{pidfd_.get(), POLLIN, 0};
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) > 0) break;
  }
  return try_wait();
}

ExitStatus Child::stop() {
  if (!running()) return status_;
  if (stop_.signal != 0 && stop_.signal != SIGKILL) {
    signal(stop_.signal);
    if (wait_for(stop_.grace)) return status_;
  }
  signal(SIGKILL);
  if (reaper_ && !wait_for(stop_.kill_wait)) {
    ::syscall(SYS_pidfd_send_signal, pidfd_.get(), SIGKILL, nullptr, 0);  // a reaper that hangs
  }
  return wait();
}

}  // namespace forkguard::launch::detail
