// Helper for the probe's GNU OpenMP tests: a stand-in for torch's CPU ops without torch. It
// dlopen()s Debian's libgomp.so.1 (no -fopenmp, so sanitizer builds stay as they are) and runs
// parallel regions through GOMP_parallel, libgomp's own entry point that `#pragma omp parallel`
// compiles to. Answers each command with one line on stdout.
//
//   load          dlopen libgomp.so.1 (or FORKGUARD_TEST_LIBGOMP)  -> "ok" | "error WHY"
//   parallel N    a parallel region of N threads (loads first)     -> "ran N" (threads that ran it)
//   dlopen PATH   dlopen another library                           -> "ok" | "error WHY"
//   probe         probe::self()                                     -> "probe VERDICT
//   KIND,KIND,..." fast          probe::self_if_fork_unsafe()                      -> "fast safe" |
//   "fast VERDICT" fork N        fork(); the child runs a parallel region of N threads and exits 0
//   (it hangs
//                 there when this process's pool is live)           -> "child PID"
//   wait MS       wait for that child at most MS ms                 -> "exited STATUS" | "running"
//   kill          SIGKILL the child and reap it                     -> "killed"
//   pid           -> "pid PID"
//   exit          exits 0 (no answer)
#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "forkguard/probe/cuda_state.hpp"

namespace probe = forkguard::probe;

namespace {

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

void* g_gomp = nullptr;
GompParallel g_parallel = nullptr;
pid_t g_child = -1;

void reply(const std::string& s) {
  std::fputs((s + "\n").c_str(), stdout);
  std::fflush(stdout);
}

std::string load() {
  if (g_parallel != nullptr) return "ok";
  const char* path = std::getenv("FORKGUARD_TEST_LIBGOMP");
  g_gomp = ::dlopen(path != nullptr ? path : "libgomp.so.1", RTLD_NOW | RTLD_LOCAL);
  if (g_gomp == nullptr) return std::string("error ") + ::dlerror();
  g_parallel = reinterpret_cast<GompParallel>(::dlsym(g_gomp, "GOMP_parallel"));
  if (g_parallel == nullptr) return std::string("error ") + ::dlerror();
  return "ok";
}

void count_thread(void* data) {
  static_cast<std::atomic<int>*>(data)->fetch_add(1);
}

int parallel(unsigned threads) {
  std::atomic<int> ran{0};
  g_parallel(count_thread, &ran, threads, 0);
  return ran.load();
}

std::string probe_line() {
  auto s = probe::self();
  std::string kinds;
  for (const auto& e : s.evidence) {
    std::string k(probe::to_string(e.kind));
    if (kinds.find(k) == std::string::npos) kinds += (kinds.empty() ? "" : ",") + k;
  }
  return "probe " + std::string(probe::to_string(s.verdict)) + " " + kinds;
}

// Waits for g_child at most `ms` through a pidfd: no polling loop.
std::string wait_child(int ms) {
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, g_child, 0));
  if (pidfd < 0) return "error pidfd_open";
  pollfd p{pidfd, POLLIN, 0};
  int ready = ::poll(&p, 1, ms);
  ::close(pidfd);
  if (ready == 0) return "running";
  int status = 0;
  ::waitpid(g_child, &status, 0);
  g_child = -1;
  return "exited " + std::to_string(status);
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    const auto space = line.find(' ');
    const std::string cmd = line.substr(0, space);
    const std::string arg = space == std::string::npos ? "" : line.substr(space + 1);
    if (cmd == "load") {
      reply(load());
    } else if (cmd == "parallel") {
      auto loaded = load();
      if (loaded != "ok") {
        reply(loaded);
        continue;
      }
      reply("ran " + std::to_string(parallel(static_cast<unsigned>(std::stoul(arg)))));
    } else if (cmd == "dlopen") {
      reply(::dlopen(arg.c_str(), RTLD_NOW | RTLD_LOCAL) != nullptr
                ? "ok"
                : std::string("error ") + ::dlerror());
    } else if (cmd == "probe") {
      reply(probe_line());
    } else if (cmd == "fast") {
      auto s = probe::self_if_fork_unsafe();
      reply(s ? "fast " + std::string(probe::to_string(s->verdict)) : "fast safe");
    } else if (cmd == "fork") {
      const unsigned threads = static_cast<unsigned>(std::stoul(arg));
      std::fflush(stdout);
      pid_t pid = ::fork();
      if (pid == 0) {
        parallel(threads);  // hangs here when the parent's pool was live at the fork
        ::_exit(0);
      }
      g_child = pid;
      reply("child " + std::to_string(pid));
    } else if (cmd == "wait") {
      reply(wait_child(std::stoi(arg)));
    } else if (cmd == "kill") {
      ::kill(g_child, SIGKILL);
      ::waitpid(g_child, nullptr, 0);
      g_child = -1;
      reply("killed");
    } else if (cmd == "pid") {
      reply("pid " + std::to_string(::getpid()));
    } else if (cmd == "exit") {
      return 0;
    } else {
      reply("error unknown command " + cmd);
    }
  }
  if (g_child > 0) {
    ::kill(g_child, SIGKILL);
    ::waitpid(g_child, nullptr, 0);
  }
  return 0;
}
